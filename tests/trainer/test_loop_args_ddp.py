"""Lightning's loop arguments on 2 real gloo processes (scripts/loop_args_worker.py): limits, the sanity
check, overfit_batches and max_time stop every process after the same step, and a limited epoch
resumes exactly; a 2-process run matches one process with twice the batch."""

from __future__ import annotations

import pytest

from support.jobs import forked, load_script, run
from support.results import assert_state_close, assert_state_equal, read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = shared_folder(tmp_path_factory, "loop_args",
                        lambda out: run(forked(2, "loop_args_worker.py", "--out", str(out))).check())
    return read_results(out, 2)


def _replicas_agree(results: list[dict]) -> None:
    assert_state_equal(results[0]["weights"], results[1]["weights"])
    assert results[0]["global_step"] == results[1]["global_step"]


def test_limits_and_a_sanity_check_match_one_process_without_one(ranks, tmp_path):
    rank0, rank1 = (r["limits"] for r in ranks)
    _replicas_agree([rank0, rank1])
    reference = load_script("loop_args_worker").fit_limits(8, str(tmp_path), sanity=0)
    assert rank0["num_training_batches"] == reference["num_training_batches"] == 2  # 0.5 of 4 batches per process
    assert rank0["global_step"] == reference["global_step"] == 4
    # Each pair of process batches is one batch of the reference: the same samples, the same order.
    merged = [sorted(a + b) for a, b in zip(rank0["trained"], rank1["trained"])]
    assert merged == [sorted(ids) for ids in reference["trained"]]
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)
    assert rank0["metrics"]["val_loss"] == rank1["metrics"]["val_loss"]
    assert rank0["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-5)


def test_overfit_batches_trains_each_processs_first_batch_every_epoch(ranks, tmp_path):
    rank0, rank1 = (r["overfit"] for r in ranks)
    _replicas_agree([rank0, rank1])
    assert rank0["trained"] == [rank0["trained"][0]] * 3 and rank1["trained"] == [rank1["trained"][0]] * 3
    assert sorted(rank0["trained"][0] + rank1["trained"][0]) == list(range(8))
    reference = load_script("loop_args_worker").fit_overfit(8, str(tmp_path))
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)


def test_max_time_stops_every_process_after_the_main_processs_step(ranks):
    rank0, rank1 = (r["max_time"] for r in ranks)
    _replicas_agree([rank0, rank1])
    # Rank 1's own clock would have stopped it after step 1; rank 0's spends the budget at step 3.
    assert rank0["global_step"] == rank1["global_step"] == 3
    assert rank0["should_stop"] and rank1["should_stop"]
    assert len(rank0["trained"]) == len(rank1["trained"]) == 3


def test_a_limited_epoch_resumes_bitwise_exactly_on_two_processes(ranks):
    for rank in ranks:
        full, resumed = rank["resume"]["full"], rank["resume"]["resumed"]
        assert_state_equal(resumed["weights"], full["weights"])
        assert resumed["global_step"] == full["global_step"] == 6
        assert resumed["trained"] == full["trained"][4:]  # the rest of epoch 1, from the checkpoint of step 4
