"""Sharded checkpoints under FSDP2 on 2 gloo processes are checked as strictly as full ones (issue 23).

One job (scripts/sharded_strict_worker.py) tries a hostile `shards/values.pt` (garbage optimizer
state, lr="evil", betas="xx", no parameter groups), a `data_states_1.pt` whose position lies past
the end of the 8-batch loader, and another number of parameter groups: every rank refuses each
naming the file, as a CheckpointError (a CheckpointMismatchError for the groups), with its model,
optimizer, schedule and loader unchanged; a fresh optimizer keeps no state DCP made for the load;
and load_state() passes over a damaged newest checkpoint to the one before.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from support.jobs import forked, run

pytestmark = pytest.mark.subprocess


def test_every_rank_refuses_damaged_and_mismatching_sharded_checkpoints_before_applying_anything(
        tmp_path: pathlib.Path) -> None:
    run(forked(2, "sharded_strict_worker.py", "--out", str(tmp_path))).check()
    for rank in range(2):
        facts = json.loads((tmp_path / f"strict{rank}.json").read_text())
        for name, file in [("garbage_state", "shards/values.pt"), ("lr_evil", "shards/values.pt"),
                           ("betas_xx", "shards/values.pt"), ("no_groups", "shards/values.pt"),
                           ("batches_consumed", "data_states_1.pt"), ("order_consumed", "data_states_1.pt")]:
            outcome = facts[name]["outcome"]
            assert outcome.startswith("CheckpointError: ") and f"{name}/{file}" in outcome, (rank, name, outcome)
            assert facts[name]["unchanged"], (rank, name)
        assert "lr='evil'" in facts["lr_evil"]["outcome"] and "betas='xx'" in facts["betas_xx"]["outcome"]
        assert "batches_consumed=1000000000" in facts["batches_consumed"]["outcome"]
        groups = facts["two_groups"]
        assert groups["outcome"].startswith("CheckpointMismatchError: "), groups
        assert "shards/values.pt" in groups["outcome"] and "parameter groups of sizes" in groups["outcome"]
        assert groups["unchanged"]
        fresh = facts["fresh"]
        assert fresh["outcome"].startswith("CheckpointError: ") and fresh["unchanged"] and fresh["optimizer_state"] == 0
        latest = facts["latest"]
        assert latest["outcome"].endswith(facts["first"]), latest
        assert latest["equal_to_first"]
        assert len(latest["warned"]) == 1 and facts["newest"] in latest["warned"][0], latest
        assert "shards/values.pt" in latest["warned"][0]
