"""HSDP on 4 real gloo processes (`ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`), and the
layout's bad input. The job: scripts/hsdp_worker.py (the `hsdp_job` fixture, conftest.py)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fittrain import Accelerator, ParallelismConfig, Trainer
from fittrain.checkpoint.consolidate import consolidate
from support.results import assert_state_close, assert_state_equal

#: HSDP averages each gradient over 2 shards' reduce-scatter, then over 2 replicas: another
#: summation order than one process's, so the weights agree to float32 rounding, not bitwise.
ONE_PROCESS_ATOL = 1e-5


@pytest.mark.subprocess
def test_hsdp_shards_over_a_2d_mesh_and_trains_as_one_process_does(hsdp_job: dict[str, Any], training: Any) -> None:
    for rank in hsdp_job["ranks"]:
        facts = rank["train"]
        assert facts["mesh"] == {"shape": (2, 2), "names": ("dp_replicate", "dp_shard"),
                                 "placements": ["Replicate", "Shard"]}
        assert (facts["strategy"], facts["distributed_type"]) == ("fsdp", "FSDP")
    batch, n, _ = training.RUNS["plain"]
    reference = training.train(Accelerator(), 4 * batch, n)  # 4 data-parallel processes of `batch` each
    assert_state_close(hsdp_job["ranks"][0]["train"]["params"], reference, atol=ONE_PROCESS_ATOL)


@pytest.mark.subprocess
def test_hsdp_resumes_bitwise_from_its_own_sharded_checkpoint(hsdp_job: dict[str, Any]) -> None:
    rank0 = hsdp_job["ranks"][0]["resume"]
    shards = hsdp_job["out"] / "hsdp_checkpoint" / "shards"  # a sharded checkpoint: DCP's shards, fittrain's metadata
    assert (shards / "metadata.json").is_file() and len(list(shards.glob("*.distcp"))) == 4
    assert_state_equal(rank0["second"], rank0["first"])


@pytest.mark.subprocess
def test_an_hsdp_checkpoint_loads_under_other_layouts(hsdp_job: dict[str, Any], training: Any,
                                                     tmp_path: pathlib.Path) -> None:
    saved = hsdp_job["ranks"][0]["resume"]["saved"]
    # FSDP2 over all 4 processes: every rank reads the shards it needs from the (2, 2) layout's files.
    assert_state_equal(hsdp_job["ranks"][0]["as_fsdp"]["loaded"], saved)
    # One process: the whole model from the shards.
    acc = Accelerator()
    model = training.make_model(seed=5)
    model, _, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=training.LR, momentum=training.MOMENTUM),
                              training.make_loader(32, 4))
    acc.load_state(hsdp_job["out"] / "hsdp_checkpoint")
    assert_state_equal(model.state_dict(), saved)
    # Offline, full weights made of the shards.
    consolidate(hsdp_job["out"] / "hsdp_checkpoint", tmp_path / "consolidated")
    assert_state_equal(load_file(tmp_path / "consolidated" / "model.safetensors"), saved)


@pytest.mark.subprocess
def test_the_trainer_takes_the_layout(hsdp_job: dict[str, Any]) -> None:
    for rank in hsdp_job["ranks"]:
        facts = rank["trainer"]
        assert facts["mesh"] == ((2, 2), ("dp_replicate", "dp_shard"))
        assert facts["steps"] == 2 and facts["loss"] == facts["loss"]  # 32 samples / (4 x 4) per step; finite


# ----------------------------------------------------------------- bad input (one process)
@pytest.mark.parametrize("sizes, message", [
    (dict(dp_shard_size=2), r"sizes multiply to 2 processes, but this run has 1\. Received: dp_replicate_size=1, "
                            r"dp_shard_size=2, tp_size=1, cp_size=1\. .*--num_processes 2"),
    (dict(cp_size=2), r"context parallelism needs CUDA attention kernels.*Received: .*cp_size=2"),
])
def test_a_layout_the_run_cannot_take_is_refused_naming_the_sizes(sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Accelerator(parallelism_config=ParallelismConfig(**sizes))


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_sizes_must_be_positive_integers(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"ParallelismConfig\(dp_shard_size=\.\.\.\) must be a positive integer.*"
                                         rf"Received: dp_shard_size={value!r}"):
        ParallelismConfig(dp_shard_size=value)


def test_a_strategy_that_contradicts_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"strategy='fsdp' contradicts the parallelism_config, whose sizes run 'auto'"):
        Accelerator(strategy="fsdp", parallelism_config=ParallelismConfig())


def test_one_process_layout_is_the_plain_loop_and_accelerates_own_config_is_accepted() -> None:
    assert Accelerator(parallelism_config=ParallelismConfig()).distributed_strategy.shards_parameters is False
    accelerate = pytest.importorskip("accelerate")  # fittrain's dev extra has it (benchmarks compare with it)
    acc = Accelerator(parallelism_config=accelerate.ParallelismConfig(dp_shard_size=1))
    assert acc.parallelism_config == ParallelismConfig()


def test_parallelism_config_must_be_one(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TypeError, match=r"parallelism_config must be a fittrain\.ParallelismConfig .*Received: "
                                        r"\{'dp_shard_size': 2\} \(dict\)"):
        Accelerator(parallelism_config={"dp_shard_size": 2})
    with pytest.raises(ValueError, match=r"parallelism_config=\.\.\.\) and Trainer\(accelerator=\.\.\.\) both"):
        Trainer(accelerator=Accelerator(), parallelism_config=ParallelismConfig(), project_dir=tmp_path)
