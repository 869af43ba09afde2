"""Best checkpoints on 2 real gloo processes (scripts/best_ckpt_worker.py): both ranks name the same
best checkpoint and score, the folders left on disk are the top 2 plus the newest (deleted once,
by the main process), and restore_best leaves the best weights on every rank, under DDP and FSDP2."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import pytest
import torch

from fittrain.checkpoint import load_model_weights
from fittrain.checkpoint.run_folders import run_checkpoints, run_folder
from support.jobs import forked, run
from support.results import read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def best_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = shared_folder(tmp_path_factory, "best",
                        lambda out: run(forked(2, "best_ckpt_worker.py", "--out", str(out))).check())
    return {"out": out, "ranks": read_results(out, 2)}


def _expected(scores: list[float], mode: str, top_k: int = 2) -> tuple[list[str], str]:
    """The folders the ranking keeps (top k plus the newest) and the best one, worked out here."""
    sign = 1.0 if mode == "min" else -1.0
    order = sorted(range(len(scores)), key=lambda i: (not math.isfinite(scores[i]), sign * scores[i], i))
    kept = sorted(set(order[:top_k]) | {len(scores) - 1})
    return [f"checkpoint_{i}" for i in kept], f"checkpoint_{order[0]}"


def _on_disk(project: pathlib.Path) -> list[str]:
    return [p.name for p in run_checkpoints(project)]  # the project's one run


@pytest.mark.parametrize("run_name,mode", [("val_loss", "min"), ("train_loss", "max"), ("fsdp", "min")])
def test_both_ranks_agree_on_the_best_and_the_folders_left_are_right(best_job, run_name, mode):
    rank0, rank1 = (rank[run_name] for rank in best_job["ranks"])
    project = best_job["out"] / run_name
    scores = rank0["seen"]  # the main process's values rank, on every process
    assert len(scores) == 6
    kept, best = _expected(scores, mode)
    assert _on_disk(project) == kept
    assert rank0["best_checkpoint"] == rank1["best_checkpoint"] == str(run_folder(project) / best)
    assert rank0["best_score"] == rank1["best_score"] == pytest.approx(max(scores) if mode == "max" else min(scores))
    if run_name != "train_loss":
        assert rank0["seen"] == rank1["seen"]  # averaged over both ranks
    else:
        assert rank0["seen"] != rank1["seen"]  # each rank's own loss: ranking on them would split the ranks


def _assert_best_weights(weights: dict[str, torch.Tensor], best_checkpoint: str) -> None:
    # model.safetensors, or under FSDP2 the shards each rank wrote, assembled
    best = load_model_weights(best_checkpoint)
    assert weights.keys() == best.keys()
    for key in best:
        assert torch.equal(weights[key], best[key]), key


def test_restore_best_leaves_the_best_weights_on_every_ddp_rank(best_job):
    rank0, rank1 = (rank["val_loss"] for rank in best_job["ranks"])
    for rank in (rank0, rank1):
        _assert_best_weights(rank["weights"], rank0["best_checkpoint"])


def test_restore_best_reshards_the_best_weights_under_fsdp(best_job):
    rank0, rank1 = (rank["fsdp"] for rank in best_job["ranks"])
    assert rank1["weights"] == {}  # the full weights are gathered onto the main process only
    _assert_best_weights(rank0["weights"], rank0["best_checkpoint"])
