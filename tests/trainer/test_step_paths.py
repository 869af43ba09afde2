"""The per-step path of Trainer.fit: without accumulation or mixed precision a batch is the hand
loop's calls (fittrain/trainer/optimization.py, `_plain_batch`); the loss and logged values are
detached once; epoch values of several metrics fold together, each exactly."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule


class Net(TrainModule):
    """A small MLP with SGD + momentum and a scheduler stepping every optimizer step."""

    def __init__(self, log: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.log_loss = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.log_loss:
            self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * 4, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, n * 4, 4)]


def hand_loop(module: Net, data: list, epochs: int) -> None:
    """What a user writes by hand: zero_grad, forward, backward, step, scheduler step."""
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    for _ in range(epochs):
        for i, batch in enumerate(data):
            opt.zero_grad()
            module.training_step(batch, i).backward()
            opt.step()
            sched.step()


class StepHooks(Callback):
    """Counts the per-step events around backward and the optimizer step, checking what they see."""

    def __init__(self) -> None:
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}

    def on_before_backward(self, trainer: Trainer) -> None:
        assert all(p.grad is None for p in trainer.module.parameters())  # zero_grad(set_to_none) ran
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer: Trainer) -> None:
        assert all(p.grad is not None for p in trainer.module.parameters())
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer: Trainer) -> None:
        self.calls["on_before_optimizer_step"] += 1


@pytest.mark.parametrize("hooks", [False, True], ids=["no hooks", "step hooks"])
def test_a_plain_fit_is_bitwise_the_hand_loop(tmp_path, hooks):
    data = batches()
    by_hand = Net()
    fitted = copy.deepcopy(by_hand)
    hand_loop(by_hand, data, epochs=2)
    recorder = StepHooks()
    trainer = Trainer(callbacks=[recorder] if hooks else [], max_epochs=2, project_dir=tmp_path,
                      enable_progress_bar=False)
    trainer.fit(fitted, data)
    for (name, a), b in zip(by_hand.state_dict().items(), fitted.state_dict().values()):
        assert torch.equal(a, b), name
    assert trainer.state.global_step == 12
    assert trainer.accelerator.step == 0  # counted per batch, reset at each end of data (Accelerate's step)
    if hooks:
        assert recorder.calls == dict.fromkeys(recorder.calls, 12)
    # The scheduler stepped after each optimizer step: 12 steps, halved every 3.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 4)


class SeesLoss(Callback):
    """Checks, after each batch, that the loss and the logged value are one detached tensor."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer: Trainer) -> None:
        loss = trainer.state.loss
        assert not loss.requires_grad and loss.grad_fn is None
        assert trainer.state.raw_metrics["loss_step"] is loss  # logged and returned: detached once
        assert trainer.state.raw_metrics["train_loss"] is loss
        self.checked += 1


def test_a_logged_and_returned_loss_is_detached_once(tmp_path):
    seen = SeesLoss()
    trainer = Trainer(callbacks=[seen], max_epochs=1, project_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(Net(log=True), batches())
    assert seen.checked == 6


class Counts(TrainModule):
    """Logs per batch a large int64 count (summed) beside float16 and float32 values: one fold for all, each
    exact."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("count", torch.tensor(2 ** 40 + self.trainer.state.batch_idx), on_epoch=True, reduce_fx="sum")
        self.log("half", torch.tensor(0.5, dtype=torch.float16), on_epoch=True)
        self.log("loss", loss, on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_epoch_values_of_several_dtypes_fold_together_exactly(tmp_path):
    data = batches(3)
    trainer = Trainer(max_epochs=1, project_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(Counts(), data)
    metrics = trainer.state.metrics
    # Stacked with the float metrics as float32, these counts would round to multiples of 2**17.
    assert metrics["count_epoch"] == 3 * 2 ** 40 + 3
    assert metrics["half_epoch"] == 0.5
    # lr=0: the weights stay, so the epoch's max loss is the largest of the three batches' losses.
    module = trainer.module
    with torch.no_grad():
        worst = max(nn.functional.mse_loss(module.net(x), y).item() for x, y in data)
    assert metrics["loss_epoch"] == worst


def test_a_loader_of_workers_stops_when_fit_raises(tmp_path):
    """The epoch's pass is iterated without a name in the loop, so an exception closes it at once: a
    DataLoader's worker processes stop while the traceback is still alive."""
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))

    class Fails(Net):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=False)
    with pytest.raises(RuntimeError, match="boom") as raised:
        Trainer(max_epochs=1, project_dir=tmp_path, enable_progress_bar=False).fit(Fails(), loader)
    assert raised.traceback  # alive here
    children = multiprocessing.active_children()
    assert not children, f"DataLoader workers still running: {children}"
