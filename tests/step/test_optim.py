"""Accumulation and the prepared optimizer/scheduler (fittrain/step/optim.py, fittrain/distributed/gradient_state.py).

The reference for every number is a plain PyTorch loop that accumulates by hand.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator
from fittrain.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from support.models import mlp, regression_data

LR = 0.1


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def reference_accumulation(model: nn.Module, dataset: TensorDataset, k: int, epochs: int = 1):
    """Plain PyTorch: add up loss/k gradients; step at every k-th batch and at the epoch's end."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(epochs):
        batches = list(DataLoader(dataset, batch_size=1))
        for i, (x, y) in enumerate(batches, start=1):
            (loss_fn(model, x, y) / k).backward()
            if i % k == 0 or i == len(batches):
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    return model, lrs


def test_accumulation_syncs_every_kth_batch_and_on_the_last_batch():
    dataset, k = regression_data(15), 4
    model = mlp(3, 4)
    reference, reference_lrs = reference_accumulation(model, dataset, k, epochs=2)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(dataset, batch_size=1), scheduler)

    for _ in range(2):  # the second epoch starts a fresh window
        synced, changed, lrs = [], [], []
        for x, y in loader:
            before = params(model)
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, x, y))
                synced.append(accelerator.sync_gradients)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            changed.append(any(not torch.equal(a, b) for a, b in zip(before, params(model))))
            lrs.append(scheduler.get_last_lr()[0])
        steps_at = [i for i, s in enumerate(synced, start=1) if s]
        assert steps_at == [4, 8, 12, 15]
        assert changed == synced  # parameters move exactly on sync batches
    assert lrs == pytest.approx(reference_lrs[15:])
    assert scheduler.get_last_lr()[0] == pytest.approx(LR * 0.5 ** 8)  # 2 epochs x 4 real steps
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


def test_optimizer_does_nothing_inside_a_window():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model = mlp(3, 4)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(regression_data(6), batch_size=1))
    grads_seen = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, x, y))
            current = [p.grad.clone() for p in model.parameters()]
            grads_seen.append(current)
            optimizer.step()
            optimizer.zero_grad()
            # zero_grad left the accumulating gradients alone, except after a real step.
            if accelerator.sync_gradients:
                assert all(p.grad is None for p in model.parameters())
            else:
                assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), current))
    # Inside a window, gradients add up batch after batch.
    assert not torch.equal(grads_seen[1][0], grads_seen[0][0])


def test_scheduler_steps_only_after_real_optimizer_steps():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model, optimizer, scheduler, loader = accelerator.prepare(
        model, optimizer, scheduler, DataLoader(regression_data(8), batch_size=2))
    lrs = []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, x, y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    # 4 batches, 2 real steps: the schedule is at step 1 after batch 2 and step 2 after batch 4.
    assert lrs == pytest.approx([LR, LR / 2, LR / 2, LR / 3])


def test_step_scheduler_with_optimizer_false_steps_on_every_call():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, step_scheduler_with_optimizer=False)
    model = mlp(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler, loader = accelerator.prepare(
        model, optimizer, scheduler, DataLoader(regression_data(8), batch_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the scheduler stepping past the optimizer
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, x, y))
                optimizer.step()
                scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(LR * 0.5 ** 4)


def test_prepared_optimizer_and_scheduler_forward_the_wrapped_api():
    accelerator = Accelerator(cpu=True)
    model = mlp(3, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    inner_scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, inner, inner_scheduler)
    assert isinstance(optimizer, AcceleratedOptimizer) and optimizer.optimizer is inner
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert isinstance(scheduler, AcceleratedScheduler) and scheduler.scheduler is inner_scheduler

    assert optimizer.param_groups is inner.param_groups
    assert optimizer.defaults is inner.defaults and optimizer.defaults["weight_decay"] == 0.01
    optimizer.param_groups[0]["lr"] = 0.05  # writes reach the real optimizer
    assert inner.param_groups[0]["lr"] == 0.05
    optimizer.param_groups[0]["lr"] = LR

    x, y = regression_data(4).tensors
    accelerator.backward(loss_fn(model, x, y))
    optimizer.step()
    scheduler.step()
    assert optimizer.state is inner.state and len(optimizer.state) == len(list(model.parameters()))
    assert scheduler.get_last_lr() == inner_scheduler.get_last_lr() == [pytest.approx(LR / 2)]
    assert scheduler.last_epoch == 1  # other attributes come from the wrapped scheduler

    # state_dict/load_state_dict are the wrapped objects' own, so they round-trip into plain ones.
    state = optimizer.state_dict()
    assert state.keys() == inner.state_dict().keys()
    plain = torch.optim.AdamW(mlp(3, 4).parameters(), lr=1.0)
    plain.load_state_dict(state)
    assert plain.param_groups[0]["lr"] == pytest.approx(LR / 2)
    assert all(torch.equal(plain.state_dict()["state"][0][k], state["state"][0][k]) for k in ("exp_avg",))
    fresh_model = mlp(3, 4)
    fresh_inner = torch.optim.AdamW(fresh_model.parameters(), lr=1.0)
    fresh = Accelerator(cpu=True).prepare(torch.optim.lr_scheduler.StepLR(fresh_inner, step_size=1, gamma=0.5))
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.last_epoch == 1

    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.3})
    assert len(inner.param_groups) == 2


def test_train_and_eval_reach_an_optimizer_that_has_them():
    """Schedule-free optimizers switch their parameters with train()/eval(); Accelerate forwards both."""
    class ScheduleFree(torch.optim.SGD):
        modes: list[str] = []

        def train(self) -> None:
            self.modes.append("train")

        def eval(self) -> None:
            self.modes.append("eval")

    acc = Accelerator(cpu=True)
    model = nn.Linear(2, 1)
    plain, free = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1), ScheduleFree(model.parameters(), lr=0.1))
    free.train(), free.eval(), free.train()
    assert free.optimizer.modes == ["train", "eval", "train"]
    plain.train(), plain.eval()  # an optimizer without them: nothing happens, as in Accelerate


def test_preparing_twice_is_a_no_op():
    accelerator = Accelerator(cpu=True)
    model = mlp(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(regression_data(4), batch_size=2)
    first = accelerator.prepare(model, optimizer, loader, scheduler)
    second = accelerator.prepare(*first)
    assert all(a is b for a, b in zip(first, second))
    assert accelerator.prepare(first[1]) is first[1]
    # Nothing was registered twice, so a checkpoint holds one of each.
    assert len(accelerator.prepared.models) == len(accelerator.prepared.optimizers) == 1
    assert len(accelerator.prepared.schedulers) == len(accelerator.prepared.dataloaders) == 1


def test_prepare_keeps_the_order_and_passes_unknown_objects_through():
    accelerator = Accelerator(cpu=True)
    model = mlp(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(regression_data(4), batch_size=2)
    extra, config = object(), {"lr": LR}
    out = accelerator.prepare(scheduler, extra, loader, config, optimizer, None, model)
    assert len(out) == 7
    assert isinstance(out[0], AcceleratedScheduler) and out[0].scheduler is scheduler
    assert out[1] is extra and out[3] is config and out[5] is None
    assert len(out[2]) == 2 and out[2].base_loader is loader
    assert isinstance(out[4], AcceleratedOptimizer) and out[4].optimizer is optimizer
    assert out[6] is model  # one process: no wrapper
    # The scheduler prepared before its optimizer in the argument list still sees real steps only.
    assert out[0].gradient_state is out[4].gradient_state is accelerator.gradient_state
    # One object in, one object out (not a tuple).
    assert Accelerator(cpu=True).prepare(extra) is extra


def test_a_scheduler_built_after_prepare_on_the_prepared_optimizer_works():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp(3, 4)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=LR), DataLoader(regression_data(8), batch_size=2))
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    assert scheduler.get_last_lr() == [LR]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "scheduler.step() before optimizer.step()"
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model, x, y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    assert scheduler.get_last_lr()[0] == pytest.approx(LR * 0.5 ** 2)
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 2)


def test_backward_divides_the_loss_by_the_accumulation_steps():
    x, y = regression_data(4).tensors
    plain = mlp(3, 4)
    loss_fn(plain, x, y).backward()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = accelerator.prepare(mlp(3, 4))
    accelerator.backward(loss_fn(model, x, y))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad / 4)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_gradient_accumulation_steps_must_be_a_positive_int(value):
    with pytest.raises(ValueError) as info:
        Accelerator(cpu=True, gradient_accumulation_steps=value)
    assert "gradient_accumulation_steps" in str(info.value) and repr(value) in str(info.value)
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        accelerator.gradient_accumulation_steps = value
    assert accelerator.gradient_accumulation_steps == 1
