"""LocalSGD and get_logger on 2 real gloo processes (scripts/local_sgd_worker.py)."""

from __future__ import annotations

import re

import pytest
import torch

from support.jobs import forked, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


def test_local_sgd_averages_every_k_steps_and_logging_picks_processes(tmp_path) -> None:
    done = run(forked(2, "local_sgd_worker.py", "--out", str(tmp_path))).check()
    ranks = read_results(tmp_path, 2)
    zero, one = ranks
    # Steps 1 and 3: each rank stepped on its own gradients (no DDP sync), so the weights differ.
    for step in (0, 2):
        assert not torch.equal(zero["after"][step], one["after"][step])
    # Steps 2 and 4: averaged, so equal on both ranks, and equal to the mean of what they held.
    for k, step in enumerate((1, 3)):
        assert torch.equal(zero["after"][step], one["after"][step])
        mean = (zero["before_average"][k] + one["before_average"][k]) / 2
        torch.testing.assert_close(zero["after"][step], mean, rtol=0, atol=1e-7)
        assert not torch.equal(zero["before_average"][k], one["before_average"][k])
    for rank in ranks:
        assert "distributed_type=FSDP" in rank["refused"] and "strategy='ddp'" in rank["refused"]

    lines = [line for line in done.output.splitlines() if line.startswith("LOG ")]
    assert lines.count("LOG [RANK 0] before the accelerator") == 1
    assert not any("before the accelerator" in line and "RANK 1" in line for line in lines)
    assert sorted(line for line in lines if "every process" in line) == [
        "LOG [RANK 0] every process", "LOG [RANK 1] every process"]
    turns = [line for line in lines if re.search(r"turn of \d", line)]
    assert turns == ["LOG [RANK 0] turn of 0", "LOG [RANK 1] turn of 1"]  # rank order, each once
