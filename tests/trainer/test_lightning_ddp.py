"""A fit written the Lightning way on 2 real gloo processes: DataModule, (batch, batch_idx), module hooks."""

from __future__ import annotations

import pytest
import torch

from support.jobs import forked, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_lightning_style_fit_runs_alike_on_both_ranks(tmp_path, strategy):
    run(forked(2, "lightning_worker.py", "--out", tmp_path, "--strategy", strategy)).check()
    ranks = read_results(tmp_path, 2)
    # prepare_data once per node (both ranks are on this one), before any rank's setup.
    assert (tmp_path / "prepared.txt").read_text().split() == ["0"]
    for rank in ranks:
        assert rank["seen_prepared"]
        # 32 samples in batches of 4, dealt to 2 ranks: 4 batches a rank per epoch, indexed from 0 each epoch;
        # under DDP and FSDP2 the step runs through the wrapper's forward, which passes batch_idx on.
        assert rank["indices"] == [0, 1, 2, 3] * 2
        assert rank["epochs_ended"] == 2
        assert rank["metrics"]["epochs_so_far"] == 2.0  # logged in on_validation_epoch_end
    assert ranks[0]["metrics"]["val_loss"] == ranks[1]["metrics"]["val_loss"]
    # self.log(sync_dist=True): step values, epoch values and epoch-hook values reduced across the ranks.
    for rank, facts in enumerate(ranks):
        metrics = facts["metrics"]
        assert (metrics["rank_step"], metrics["rank_step_too"], metrics["rank_epoch"]) == (0.5, 1.0, 0.5)
        assert metrics["rank_max"] == 1.0 and metrics["rank_local"] == rank
    for key, value in ranks[0]["weights"].items():
        if key in ranks[1]["weights"]:
            assert torch.equal(value, ranks[1]["weights"][key]), f"the ranks' weights differ at {key}"


def test_sync_dist_costs_one_collective_per_logging_point(tmp_path):
    """Issue 25: sync_dist reduces all of a logging point's values together. The same fit logs the same
    values with and without sync_dist; the difference in collectives is one per logging point."""
    synced, local = tmp_path / "synced", tmp_path / "local"
    for out, sync in ((synced, "on"), (local, "off")):
        out.mkdir()
        run(forked(2, "lightning_worker.py", "--out", out, "--sync", sync)).check()
    for with_sync, without in zip(read_results(synced, 2), read_results(local, 2)):
        extra = {name: with_sync["collectives"][name] - without["collectives"][name]
                 for name in with_sync["collectives"]}
        # 2 epochs of 4 batches: each batch's two step values in one all_reduce (8), each epoch's
        # running mean in one (2), and on_train_epoch_end's value in one (2). Nothing else moves.
        batches, epoch_ends, epoch_hook_calls = 8, 2, 2
        assert extra == {"all_reduce": batches + epoch_ends + epoch_hook_calls, "all_gather": 0,
                         "all_gather_object": 0, "broadcast": 0, "broadcast_object_list": 0, "barrier": 0}
