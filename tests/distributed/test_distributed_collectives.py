"""Collectives and uneven data on 2 real gloo processes (read from the shared `ddp_job` launch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.results import assert_state_equal

pytestmark = pytest.mark.subprocess


def _metrics(ddp_job: dict[str, Any]) -> list[dict[str, Any]]:
    return [rank["metrics"] for rank in ddp_job["ranks"]]


def _collectives(ddp_job: dict[str, Any]) -> list[dict[str, Any]]:
    return [rank["collectives"] for rank in ddp_job["ranks"]]


def test_gather_for_metrics_yields_exactly_the_27_samples(ddp_job: dict[str, Any]) -> None:
    # 27 samples, batch 4, 2 processes: the last round holds 3 real samples and 5 repeats.
    for metrics in _metrics(ddp_job):
        assert metrics["even_27"] == list(range(27))


def test_an_inner_loader_run_inside_the_last_batch_leaves_the_outer_padding_known(ddp_job: dict[str, Any]) -> None:
    # An evaluation loop inside the training loop: on the outer loader's last batch gather_for_metrics
    # must still drop the padding repeats (27, not 32), and the inner loop's own (10, not 12).
    for metrics in _metrics(ddp_job):
        assert metrics["nested_27"] == {"outer": list(range(27)), "inner": list(range(10))}


def test_uneven_batches_split_the_data_without_repeats_and_without_hanging(ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = (m["uneven_27"] for m in _metrics(ddp_job))
    assert (rank0["len"], rank1["len"]) == (4, 3)  # rank 1 gets no last batch
    assert sorted(rank0["local"] + rank1["local"]) == list(range(27))
    for rank in (rank0, rank1):
        assert sorted(rank["gathered"]) == list(range(27))


def test_fewer_batches_than_processes_still_gives_every_rank_a_step(ddp_job: dict[str, Any]) -> None:
    for metrics in _metrics(ddp_job):
        assert metrics["even_3"] == [0, 1, 2]  # padded to one batch each, repeats dropped
        assert metrics["few_batches_step"]["steps"] == 1
    params = [m["few_batches_step"]["params"] for m in _metrics(ddp_job)]
    assert_state_equal(params[1], params[0])


def test_fewer_batches_than_processes_with_uneven_batches(ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = (m["uneven_3"] for m in _metrics(ddp_job))
    assert (rank0["len"], rank1["len"]) == (1, 0)
    assert (rank0["local"], rank1["local"]) == ([0, 1, 2], [])
    assert rank0["gathered"] == rank1["gathered"] == [0, 1, 2]


def test_gather_of_mismatched_shapes_is_an_error_naming_them(ddp_job: dict[str, Any]) -> None:
    for result in _collectives(ddp_job):
        assert "rank 0: [2, 3], rank 1: [2, 4]" in result["mismatch_shape"]
        assert "pad_across_processes" in result["mismatch_shape"]
        assert "rank 0: torch.float32, rank 1: torch.int64" in result["mismatch_dtype"]


def test_collectives_after_an_error_still_line_up(ddp_job: dict[str, Any]) -> None:
    for result in _collectives(ddp_job):
        assert torch.equal(result["gather_nested"]["a"], torch.tensor([0, 1]))
        assert torch.equal(result["gather_nested"]["b"][0], torch.tensor([[0.0] * 2] * 2 + [[1.0] * 2] * 2))
        assert torch.equal(result["gather_scalar"], torch.tensor([0.0, 1.0]))


def test_reduce_broadcast_and_padding(ddp_job: dict[str, Any]) -> None:
    for rank, result in enumerate(_collectives(ddp_job)):
        assert torch.equal(result["reduce_sum"], torch.tensor([2.0, 1.0]))
        assert torch.equal(result["reduce_mean"], torch.tensor([1.0, 0.5]))
        assert torch.equal(result["broadcast_tensor"], torch.tensor([11]))
        assert result["broadcast_object"] == {"stop": True}
        expected = torch.ones(2, 2) if rank == 1 else torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
        assert torch.equal(result["padded"], expected)


def test_split_between_processes_and_main_process_first(ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = _collectives(ddp_job)
    assert (rank0["split"], rank1["split"]) == ([0, 1, 2], [3, 4])
    assert rank0["main_first_order"] == ["0", "1"]


def test_split_batches_splits_each_batch_across_processes(ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = (m["split_16"] for m in _metrics(ddp_job))
    assert rank0["local"] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert rank1["local"] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert rank0["gathered"] == rank1["gathered"] == list(range(16))


def test_print_runs_on_the_main_process_only(ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = _collectives(ddp_job)
    assert (rank0["printed"], rank1["printed"]) == ("hello from 0\n", "")
