"""DDP on 2 real gloo processes: process facts, equivalence with 1 process, accumulation, checkpoints.

All of these read one `fittrain launch --num_processes 2 --strategy ddp` job (the `ddp_job`
fixture), so the launch itself, the strategy export and argument pass-through are tested too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.results import assert_state_close, assert_state_equal

pytestmark = pytest.mark.subprocess


def test_process_facts_come_from_the_launcher(ddp_job: dict[str, Any]) -> None:
    facts = [rank["facts"] for rank in ddp_job["ranks"]]
    for r, fact in enumerate(facts):
        assert fact["num_processes"] == fact["world_size"] == 2
        assert fact["process_index"] == r == int(fact["env_rank"])
        assert fact["local_process_index"] == r  # one node: local rank is the global rank
        assert fact["is_main_process"] == fact["is_local_main_process"] == (r == 0)
        assert fact["distributed_type"] == "MULTI_CPU"
        assert (fact["backend"], fact["device"]) == ("gloo", "cpu")


def test_launch_exports_strategy_and_passes_script_arguments_through(ddp_job: dict[str, Any]) -> None:
    for rank in ddp_job["ranks"]:
        assert rank["facts"]["strategy_env"] == "ddp"
        assert rank["facts"]["script_args"] == ["--lr", "0.5", "--flag"]


def test_two_processes_with_batch_b_match_one_process_with_batch_2b(
        ddp_job: dict[str, Any], one_process_references: dict[str, dict[str, torch.Tensor]]) -> None:
    rank0, rank1 = (rank["ddp_runs"]["plain"] for rank in ddp_job["ranks"])
    assert rank0["model_type"] == "DistributedDataParallel"
    assert rank0["unwrapped_type"] == "Sequential"  # unwrap_model returns the user's module
    assert_state_equal(rank1["params"], rank0["params"])  # replicas agree exactly
    assert_state_close(rank0["params"], one_process_references["plain"], atol=1e-6)


def test_accumulation_all_reduces_only_on_sync_steps(
        ddp_job: dict[str, Any], one_process_references: dict[str, dict[str, torch.Tensor]]) -> None:
    # 10 batches per rank and epoch with 4 accumulation steps: windows close on batches 3, 7 and
    # 9 (the loader's end), and the count restarts each epoch (batches 10-19).
    for rank in ddp_job["ranks"]:
        assert rank["ddp_runs"]["accumulate"]["allreduce_batches"] == [3, 7, 9, 13, 17, 19]
    rank0, rank1 = (rank["ddp_runs"]["accumulate"]["params"] for rank in ddp_job["ranks"])
    assert_state_equal(rank1, rank0)
    assert_state_close(rank0, one_process_references["accumulate"], atol=1e-6)


def test_without_accumulation_every_step_all_reduces(ddp_job: dict[str, Any]) -> None:
    for rank in ddp_job["ranks"]:
        assert rank["ddp_runs"]["plain"]["allreduce_batches"] == list(range(8))


def test_save_state_load_state_round_trips_exactly(ddp_job: dict[str, Any]) -> None:
    for rank in ddp_job["ranks"]:
        result = rank["checkpoint"]
        # The epoch after load_state replays the epoch after save_state bit for bit: model,
        # Adam state, data order, dropout masks and this rank's RNG all came back.
        assert_state_equal(result["second"]["params"], result["first"]["params"])
        assert torch.equal(result["second"]["draw"], result["first"]["draw"])
        saved, loaded = result["optimizer_saved"], result["optimizer_loaded"]
        assert saved["param_groups"] == loaded["param_groups"]
        for index, state in saved["state"].items():
            for key, value in state.items():
                assert torch.equal(loaded["state"][index][key], value)
    # Different RNG per rank, so restoring the wrong file would have shown above.
    draws = [rank["checkpoint"]["first"]["draw"] for rank in ddp_job["ranks"]]
    assert not torch.equal(draws[0], draws[1])


def test_each_rank_writes_its_rng_and_data_states_and_only_the_main_writes_shared_files(
        ddp_job: dict[str, Any]) -> None:
    rank0, rank1 = (rank["checkpoint"] for rank in ddp_job["ranks"])
    assert sorted(rank1["written"]) == ["data_states_1.pt", "random_states_1.pt"]
    assert {"random_states_0.pt", "data_states_0.pt"} <= set(rank0["written"])
    assert not {"random_states_1.pt", "data_states_1.pt"} & set(rank0["written"])
    assert {"model.safetensors", "optimizer.pt"} <= set(rank0["written"])
    assert {"random_states_0.pt", "random_states_1.pt", "data_states_0.pt", "data_states_1.pt",
            "manifest.json"} <= set(rank0["files"])


def test_end_training_destroys_the_process_group(ddp_job: dict[str, Any]) -> None:
    for rank in ddp_job["ranks"]:
        assert rank["end_training"] == {"before": True, "after": False}
