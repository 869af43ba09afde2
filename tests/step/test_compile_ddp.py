"""`Trainer(compile=...)` on 2 real gloo processes, under DDP and FSDP2 (scripts/compile_worker.py).

Each rank fits a compiled module for 2 epochs with validation and checkpoints, then resumes from
a mid-epoch checkpoint. A counting backend shows that neither the wrapper nor fittrain's step
code compiles more graphs on a process than the same module compiled in a plain one-process
loop, and the checkpoints hold the plain parameter names.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.jobs import forked, load_script, run
from support.results import assert_state_close, read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess

STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def worker() -> Any:
    return load_script("compile_worker")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    found = {}
    for strategy in STRATEGIES:
        out = shared_folder(tmp_path_factory, f"compile_{strategy}", lambda out, strategy=strategy: run(
            forked(2, "compile_worker.py", "--out", str(out), "--strategy", strategy)).check())
        found[strategy] = read_results(out, 2)
    return found


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_process_compiles_more_than_a_plain_loop(jobs, worker, strategy: str) -> None:
    baseline = worker.hand_written_graphs(strategy)
    assert baseline >= 1
    for rank in jobs[strategy]:
        assert rank["world"] == 2
        assert (rank["first"]["steps"], rank["resumed"]["steps"]) == (4, 6)
        assert rank["first"]["graphs"] == baseline
        assert rank["resumed"]["graphs"] == baseline


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoints_keep_the_plain_names(jobs, worker, strategy: str) -> None:
    plain = sorted(worker.Net().state_dict())
    for rank in jobs[strategy]:
        assert rank["saved_keys"] == plain


def test_ranks_and_strategies_agree(jobs) -> None:
    ddp, fsdp = (jobs[s][0] for s in STRATEGIES)
    for stage in ("first", "resumed"):
        assert jobs["ddp"][1][stage]["val_loss"] == ddp[stage]["val_loss"]
        assert fsdp[stage]["val_loss"] == pytest.approx(ddp[stage]["val_loss"], rel=1e-5)
        assert_state_close(fsdp[stage]["weights"], ddp[stage]["weights"], atol=1e-5)
