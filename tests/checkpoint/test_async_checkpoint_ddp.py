"""save_state(async_save=True) on 2 real gloo processes: background writes that synchronise on a
group of their own while DDP goes on training (scripts/async_checkpoint_worker.py)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from support.jobs import forked, run
from support.results import assert_state_equal, read_results

pytestmark = pytest.mark.subprocess


def test_two_processes_write_checkpoints_in_the_background_while_training(tmp_path):
    run(forked(2, "async_checkpoint_worker.py", "--out", str(tmp_path))).check()
    rank0, rank1 = read_results(tmp_path, 2)
    assert rank0["steps"] == rank1["steps"] == 16
    # Both ranks trained on while their writes were in flight (rank 1's writes are the slow ones).
    assert rank0["overlapping_steps"] >= 3 and rank1["overlapping_steps"] >= 3
    # Four background saves and a synchronous one, numbered by save; the oldest were pruned once
    # the newer ones were committed (total_limit=3).
    assert sorted(rank0["saved"]) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert rank0["synced"] == rank1["synced"] == "checkpoint_4"
    assert rank0["listing"] == rank1["listing"] == ["checkpoint_2", "checkpoint_3", "checkpoint_4"]
    checkpoints = tmp_path / "project" / "checkpoints"
    for name in rank0["listing"]:
        files = sorted(p.name for p in (checkpoints / name).iterdir())
        assert "random_states_0.pt" in files and "random_states_1.pt" in files and "manifest.json" in files
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]
    # Each background checkpoint holds the weights of its step (12, 16), not those of the steps
    # trained while it was written.
    for name in ("checkpoint_2", "checkpoint_3"):
        on_disk = safetensors.torch.load_file(checkpoints / name / "model.safetensors")
        assert_state_equal(on_disk, rank0["saved"][name])
        assert_state_equal(on_disk, rank1["saved"][name])
    assert any(not torch.equal(v, rank0["final"][k]) for k, v in rank0["saved"]["checkpoint_2"].items())
    # load_state() found the newest checkpoint on both ranks and restored its weights (the last step's).
    for rank in (rank0, rank1):
        assert rank["loaded"] == str(checkpoints / "checkpoint_4")
        assert_state_equal(rank["after_load"], rank["final"])
