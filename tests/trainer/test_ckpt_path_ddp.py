"""`ckpt_path=` on 2 real gloo processes (scripts/ckpt_path_worker.py), under DDP and FSDP2 (sharded
checkpoints): every rank evaluates the same checkpoint, the one the Checkpointer names; the weights
are the saved ones, bit for bit; a fresh Trainer predicts with them; and a path every rank must refuse
is refused by every rank alike, so none waits for the others."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fittrain.checkpoint import load_model_weights
from support.jobs import forked, run
from support.results import assert_state_equal, read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = shared_folder(tmp_path_factory, "ckpt_path",
                        lambda out: run(forked(2, "ckpt_path_worker.py", "--out", str(out))).check())
    return read_results(out, 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_evaluates_the_checkpoint_the_checkpointer_names(ranks, strategy):
    rank0, rank1 = (rank[strategy] for rank in ranks)
    for key in ("best", "last", "link", "test"):
        assert rank0[key] == rank1[key], key
    assert rank0["best"] != rank0["last"]  # the test can tell them apart
    best, last = load_model_weights(rank0["best"]), load_model_weights(rank0["last"])
    assert not all(torch.equal(best[k], last[k]) for k in best)
    # Full weights: on both DDP ranks; under FSDP2 gathered onto the main process.
    holders = (rank0, rank1) if strategy == "ddp" else (rank0,)
    for rank in holders:
        assert_state_equal(rank["after_fit"], last)
        assert_state_equal(rank["after_best"], best)
        assert_state_equal(rank["after_last"], last)
    if strategy == "fsdp":
        assert rank1["after_best"] == {}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_fresh_trainer_predicts_with_the_checkpoints_weights(ranks, strategy):
    rank0, rank1 = (rank[strategy] for rank in ranks)
    best = load_model_weights(rank0["best"])
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net.load_state_dict({k.removeprefix("net."): v for k, v in best.items()})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=g)
    torch.testing.assert_close(rank0["predicted"], net(x).detach())
    assert torch.equal(rank0["predicted"], rank1["predicted"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_path_the_main_process_refuses_is_refused_on_every_rank(ranks, strategy):
    rank0, rank1 = (rank[strategy] for rank in ranks)
    assert rank0["refused"] is not None and "is incomplete: it has no manifest.json" in rank0["refused"]
    assert rank1["refused"] == rank0["refused"]
