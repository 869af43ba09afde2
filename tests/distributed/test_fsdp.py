"""FSDP2 on 2 real gloo processes (one torchrun job, the `fsdp_job` fixture), and FSDP's bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from fittrain import Accelerator, DistributedType
from fittrain.distributed import parallel
from support.results import assert_state_close, assert_state_equal

pytestmark = pytest.mark.subprocess


def test_prepare_rebinds_an_optimizer_built_before_it(fsdp_job: dict[str, Any]) -> None:
    for rank in fsdp_job["ranks"]:
        facts = rank["rebinding"]
        assert facts["is_fsdp"] and facts["unwrapped_is_model"]
        assert facts["distributed_type"] == "FSDP"
        assert facts["same_objects"] and facts["all_dtensor"]
        assert facts["fsdp_units"] == 4  # three Linear layers, then the root


def test_prepare_rebinds_an_optimizer_prepared_in_a_later_call(fsdp_job: dict[str, Any]) -> None:
    for rank in fsdp_job["ranks"]:
        assert rank["rebinding_later"] == {"same_objects": True, "moved": True}


def test_fsdp_with_batch_b_matches_one_process_with_batch_2b(
        fsdp_job: dict[str, Any], one_process_references: dict[str, dict[str, torch.Tensor]]) -> None:
    rank0, rank1 = (rank["fsdp_runs"] for rank in fsdp_job["ranks"])
    assert rank1["plain"]["params"] == {}  # the full state is gathered to the main process only
    for name in ("plain", "accumulate"):
        assert_state_close(rank0[name]["params"], one_process_references[name], atol=1e-5)


def test_fsdp_accumulation_reduces_gradients_only_on_sync_steps(fsdp_job: dict[str, Any]) -> None:
    # Sharded gradients appear only after a reduce-scatter; inside the window FSDP2 keeps
    # unsharded local gradients, and the sharded parameters' .grad stays None.
    for rank in fsdp_job["ranks"]:
        for batch, sync, has_grad in rank["fsdp_runs"]["accumulate"]["grads"]:
            assert has_grad == sync, f"batch {batch}: sync={sync} but sharded grads present={has_grad}"
        assert [b for b, sync, _ in rank["fsdp_runs"]["accumulate"]["grads"] if sync] == [3, 7, 9, 13, 17, 19]


def test_save_model_under_fsdp_writes_full_weights_for_a_plain_module(
        fsdp_job: dict[str, Any], training: Any) -> None:
    expected = fsdp_job["ranks"][0]["save_model"]["params"]
    plain = training.make_model(seed=99)
    plain.load_state_dict(load_file(fsdp_job["out"] / "saved" / "model.safetensors"), strict=True)
    assert_state_equal(plain.state_dict(), expected)


def test_full_optimizer_state_round_trips_through_a_file(fsdp_job: dict[str, Any]) -> None:
    rank0 = fsdp_job["ranks"][0]["optimizer_helpers"]
    assert rank0["saved_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert fsdp_job["ranks"][1]["optimizer_helpers"]["saved_keys"] == []  # gathered on the main only
    assert_state_equal(rank0["second"], rank0["first"])


def test_save_state_load_state_round_trip_under_fsdp(fsdp_job: dict[str, Any]) -> None:
    rank0 = fsdp_job["ranks"][0]["accelerator_state"]
    assert "error" not in rank0, rank0.get("error")
    assert_state_equal(rank0["second"], rank0["first"])


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_fsdp_on_one_process_warns_once_and_trains_unsharded() -> None:
    accelerator = Accelerator(strategy="fsdp")
    model, optimizer = _tiny()
    with pytest.warns(UserWarning) as caught:
        model, optimizer = accelerator.prepare(model, optimizer)
    ours = [w for w in caught if "strategy='fsdp'" in str(w.message)]
    assert len(ours) == 1
    assert "fittrain launch --num_processes" in str(ours[0].message)
    assert ours[0].filename == __file__  # points at the user's prepare() line
    assert accelerator.distributed_type == DistributedType.NO
    assert not parallel.is_fsdp(model)
    before = model.weight.detach().clone()
    accelerator.backward(F.mse_loss(model(torch.ones(2, 3)), torch.zeros(2, 1)))
    optimizer.step()
    assert not torch.equal(model.weight, before)


def test_rebinding_an_optimizer_that_already_stepped_is_an_error() -> None:
    model, optimizer = _tiny()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    replacement = {id(p): nn.Parameter(p.detach().clone()) for p in model.parameters()}
    with pytest.raises(ValueError, match="already stepped"):
        parallel.rebind_optimizer(optimizer, replacement)


def test_fsdp_classes_must_be_module_classes() -> None:
    # Refused when the Accelerator is built, before any process group or model exists.
    with pytest.raises(TypeError, match=r"fsdp_classes.*Received: fsdp_classes=\['Linear'\]"):
        Accelerator(strategy="fsdp", fsdp_classes=["Linear"])
