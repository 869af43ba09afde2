"""Accelerate's configuration objects on 2 real gloo processes (see scripts/config_worker.py)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from support.jobs import fittrain_launch, forked, job_env, run
from support.results import assert_state_equal, read_results

pytestmark = pytest.mark.subprocess


def test_ddp_kwargs_accumulation_plugin_trigger_and_join_on_two_processes(tmp_path: pathlib.Path) -> None:
    run(forked(2, "config_worker.py", str(tmp_path))).check()
    rank0, rank1 = read_results(tmp_path, 2)
    assert_state_equal(rank1["find_unused"], rank0["find_unused"])  # trained, with the unused branch allowed
    # Rank r's batch (2 rows) is all r + 1, so its local weight gradient is 2(r + 1) per element; inside a
    # window of 2 the loss is halved: 1 and 2 locally, 1.5 averaged. Without accumulation: 2, 4, averaged 3.
    assert torch.equal(rank0["synced"], torch.full((1, 2), 1.5)) and torch.equal(rank1["synced"], rank0["synced"])
    assert torch.equal(rank0["local"], torch.full((1, 2), 1.0)) and torch.equal(rank1["local"], torch.full((1, 2), 2.0))
    assert torch.equal(rank0["trigger"], torch.full((1, 2), 3.0)) and torch.equal(rank1["trigger"], rank0["trigger"])
    assert (rank0["join_steps"], rank1["join_steps"]) == (3, 2)
    assert torch.equal(rank0["rng"]["draw"], rank1["rng"]["draw"])


def test_init_process_group_kwargs_timeout_ends_a_collective_with_an_absent_peer() -> None:
    job = run(fittrain_launch(2, "fail_worker.py", "stall_kwargs"), env=job_env())
    assert job.returncode == 7, job.output[-4000:]
    waited = float(re.search(r"collective failed after ([\d.]+)s", job.output).group(1))
    assert 2.5 <= waited < 30.0, job.output[-4000:]
