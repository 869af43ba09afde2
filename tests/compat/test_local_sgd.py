"""`fittrain.local_sgd.LocalSGD` on one process, and its argument checks (2 processes:
tests/compat/test_local_sgd_ddp.py)."""

from __future__ import annotations

import pytest
import torch

from fittrain import Accelerator
from fittrain.local_sgd import LocalSGD


def test_one_process_is_a_no_op() -> None:
    acc = Accelerator(cpu=True)
    model, optimizer = acc.prepare(torch.nn.Linear(3, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with LocalSGD(acc, model, local_sgd_steps=1) as local_sgd:
        assert local_sgd.enabled is False
        before = [p.detach().clone() for p in model.parameters()]
        local_sgd.step()
        local_sgd.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert local_sgd.num_steps == 2


@pytest.mark.parametrize("steps", [0, -1, 1.5, "8", True])
def test_local_sgd_steps_must_be_a_positive_int(steps) -> None:
    with pytest.raises(ValueError, match=r"LocalSGD\(local_sgd_steps=...\).*Received: local_sgd_steps="):
        LocalSGD(Accelerator(cpu=True), torch.nn.Linear(2, 2), local_sgd_steps=steps)


def test_enabled_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"LocalSGD\(enabled=...\).*Received: enabled='yes'"):
        LocalSGD(Accelerator(cpu=True), torch.nn.Linear(2, 2), local_sgd_steps=2, enabled="yes")


def test_disabled_it_takes_no_step_count() -> None:
    # Accelerate's by_feature/local_sgd.py passes enabled=local_sgd_steps is not None.
    with LocalSGD(Accelerator(cpu=True), torch.nn.Linear(2, 2), local_sgd_steps=None, enabled=False) as local_sgd:
        local_sgd.step()
    assert local_sgd.enabled is False


def test_fsdp_is_refused_on_one_process_too() -> None:
    # Refused by the strategy's name, so a script tried on one process fails as it would on many.
    with pytest.raises(NotImplementedError, match=r"strategy='fsdp'.*Accelerator\(strategy='ddp'\)"):
        LocalSGD(Accelerator(cpu=True, strategy="fsdp"), torch.nn.Linear(2, 2), local_sgd_steps=2)
