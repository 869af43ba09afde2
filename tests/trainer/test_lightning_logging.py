"""Lightning's logging habits in evaluation steps: log the loss with self.log and return it too."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


def make_loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def mean_error(net: nn.Module, loader: DataLoader) -> float:
    """The per-sample mean of |net(x) - y| over the loader (batches of unequal size weighted by size)."""
    with torch.no_grad():
        errors = torch.cat([(net(x) - y).abs().flatten() for x, y in loader])
    return float(errors.mean())


class LogsAndReturns(TrainModule):
    """Logs each evaluation loss and returns twice that: the logged value is the one recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def _loss(self, batch):
        x, y = batch
        return (self.net(x) - y).abs().mean()

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return 2 * loss

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_logged_loss_that_is_also_returned_is_recorded_once_as_logged(tmp_path):
    module, loader = LogsAndReturns(), make_loader()
    trainer = Trainer(max_epochs=1, project_dir=tmp_path)
    trainer.fit(module, loader, loader)
    assert trainer.state.metrics["val_loss"] == pytest.approx(mean_error(module.net, loader), rel=1e-5)
    # Before, test_step's returned scalar became 'val_loss' and then 'test_loss' beside the logged one:
    # a ValueError about 'val_loss', a name this test_step never used.
    assert trainer.test(module, loader) == pytest.approx({"test_loss": mean_error(module.net, loader)}, rel=1e-5)


@pytest.mark.parametrize("as_number", [lambda loss: loss, lambda loss: loss.item(), lambda loss: loss.numpy()[()]],
                         ids=["tensor", "float", "numpy-float32"])
def test_a_test_steps_scalar_return_alone_is_test_loss(tmp_path, as_number):
    class Returns(LogsAndReturns):
        def test_step(self, batch, batch_idx):
            return as_number(self._loss(batch).detach())

    module, loader = Returns(), make_loader()
    assert Trainer(project_dir=tmp_path).test(module, loader) == pytest.approx(
        {"test_loss": mean_error(module.net, loader)}, rel=1e-5)


# ----------------------------------------------------------------- self.log's options (fittrain/trainer/logged.py)
class Logs(TrainModule):
    """Logs `value(x)` per training batch with `options`; x holds 10 samples in batches of 4, 4, 2."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.options = options
        self.seen: list[tuple[float, int]] = []  # (batch value, batch size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        value = x[:, 0].mean()
        self.seen.append((float(value), len(x)))
        self.log("a", value, **self.options)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, module, epochs=1, **trainer_options):
    trainer = Trainer(max_epochs=epochs, project_dir=tmp_path, enable_progress_bar=False, **trainer_options)
    trainer.fit(module, make_loader())
    return trainer


def test_a_training_value_is_a_step_value_by_default(tmp_path):
    module = Logs()
    trainer = _fit(tmp_path, module)
    assert trainer.state.metrics["a"] == pytest.approx(module.seen[-1][0])
    assert "a_step" not in trainer.state.metrics and "a_epoch" not in trainer.state.metrics


@pytest.mark.parametrize("reduce_fx", ["mean", "sum", "max", "min", torch.mean])
def test_on_epoch_reduces_over_the_epochs_batches_weighting_the_mean_by_batch_size(tmp_path, reduce_fx):
    module = Logs(on_step=False, on_epoch=True, reduce_fx=reduce_fx)
    metrics = _fit(tmp_path, module).state.metrics
    values, sizes = torch.tensor([v for v, _ in module.seen]), torch.tensor([n for _, n in module.seen])
    name = reduce_fx if isinstance(reduce_fx, str) else "mean"
    expected = {"mean": float((values * sizes).sum() / sizes.sum()), "sum": float(values.sum()),
                "max": float(values.max()), "min": float(values.min())}[name]
    assert metrics["a"] == pytest.approx(expected, rel=1e-6)


class LogsWhatChangesLater(TrainModule):
    """Logs tensors that change in place after the call: a 0-d parameter (the optimizer steps it), a view
    of a parameter, and a buffer the step adds to, recording their values at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("count", torch.tensor(0.0))
        self.seen: dict[str, list[float]] = {"scale": [], "weight": [], "count": []}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.count += 1
        for name, value in (("scale", self.scale), ("weight", self.net.weight[0, 0]), ("count", self.count)):
            self.seen[name].append(float(value))
            self.log(name, value, on_step=True, on_epoch=True, reduce_fx="sum")
        return nn.functional.mse_loss(self.net(x) * self.scale, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_tensor_changed_in_place_after_self_log_keeps_the_value_it_had_when_logged(tmp_path):
    """As in Lightning: a logged parameter, view or accumulator is its value at the call, for the step value
    and for each batch of the epoch's reduction (before, they all read the tensor's latest value)."""
    module = LogsWhatChangesLater()
    metrics = _fit(tmp_path, module).state.metrics
    for name, seen in module.seen.items():
        assert len(set(seen)) == 3, f"{name} did not change between batches: the test would prove nothing"
        assert metrics[f"{name}_step"] == pytest.approx(seen[-1], rel=1e-6), name
        assert metrics[f"{name}_epoch"] == pytest.approx(sum(seen), rel=1e-6), name


def test_both_give_step_and_epoch_names_and_the_trackers_get_only_those(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fittrain.callbacks import Logger

    module = Logs(on_step=True, on_epoch=True)
    trainer = Trainer(max_epochs=2, project_dir=tmp_path, callbacks=[Logger(every_n_steps=1)], run_name="r")
    trainer.fit(module, make_loader())
    metrics = trainer.state.metrics
    last_epoch = module.seen[3:]
    mean = sum(v * n for v, n in last_epoch) / sum(n for _, n in last_epoch)
    assert metrics["a_step"] == pytest.approx(last_epoch[-1][0])
    assert metrics["a_epoch"] == pytest.approx(mean) and metrics["a"] == metrics["a_epoch"]
    events = EventAccumulator(str(tmp_path / "logs" / "r"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "a_step" in tags and "a_epoch" in tags and "a" not in tags
    assert [e.step for e in events.Scalars("a_epoch")] == [3, 6]  # once per epoch, at its last step
    assert events.Scalars("a_epoch")[-1].value == pytest.approx(mean)


def test_logger_false_keeps_a_value_from_the_trackers_but_not_from_callbacks(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fittrain.callbacks import Logger

    trainer = Trainer(project_dir=tmp_path, callbacks=[Logger(every_n_steps=1)], run_name="r")
    trainer.fit(Logs(logger=False), make_loader())
    events = EventAccumulator(str(tmp_path / "logs" / "r"))
    events.Reload()
    assert "a" in trainer.state.metrics and "a" not in events.Tags()["scalars"]
    assert "train_loss" in events.Tags()["scalars"]


def test_prog_bar_shows_the_value_on_the_bar(tmp_path, capsys):
    Trainer(project_dir=tmp_path, run_name="r").fit(Logs(prog_bar=True), make_loader())
    assert "a=" in capsys.readouterr().err


def test_an_interrupted_epoch_ends_with_the_same_epoch_value(tmp_path):
    from fittrain.callbacks import Checkpointer

    whole = _fit(tmp_path / "whole", Logs(on_epoch=True), epochs=2).state.raw_metrics["a_epoch"]
    Trainer(max_steps=4, project_dir=tmp_path / "cut", enable_progress_bar=False,
            callbacks=[Checkpointer(every_n_steps=1)]).fit(Logs(on_epoch=True), make_loader())
    resumed = Trainer(max_epochs=2, project_dir=tmp_path / "cut", resume_from="latest", enable_progress_bar=False,
                      callbacks=[Checkpointer(every_n_steps=1)])
    resumed.fit(Logs(on_epoch=True), make_loader())  # resumes after the first batch of epoch 2
    assert resumed.state.raw_metrics["a_epoch"] == whole  # the same float64 fold, cut or not


@pytest.mark.parametrize("where, options, message", [
    ("validation_step", {"on_step": True}, r"in validation_step and test_step, fittrain records the mean"),
    ("validation_step", {"reduce_fx": "max"}, r"in validation_step and test_step, fittrain records the mean"),
    ("on_train_epoch_end", {"on_step": True}, r"outside a training batch .* there is no step to log at"),
    ("training_step", {"on_step": False}, r"on_step=False and on_epoch=False record nothing"),
    ("training_step", {"reduce_fx": "median"}, r"reduce_fx=\.\.\.\) must be one of mean, sum, max, min.*'median'"),
    ("training_step", {"enable_graph": True}, r"enable_graph=True\.\.\.\): fittrain does not support this option"),
    ("training_step", {"rank_zero_only": True}, r"rank_zero_only=True\.\.\.\): fittrain does not support"),
])
def test_options_a_place_cannot_honour_are_refused_naming_them(tmp_path, where, options, message):
    def call(self, *args):
        self.log("b", 1.0, **options)
        if where == "training_step":
            return LogsAndReturns.training_step(self, *args)
        if where == "validation_step":
            return LogsAndReturns.validation_step(self, *args)

    module = type("Refused", (LogsAndReturns,), {where: call})()
    loader = make_loader()
    with pytest.raises(ValueError, match=message):
        Trainer(max_epochs=1, project_dir=tmp_path, enable_progress_bar=False).fit(module, loader, loader)


def test_numbers_of_every_kind_lightning_takes_are_logged_as_floats(tmp_path):
    """Lightning takes any number (numbers.Number): NumPy scalars (sklearn and NumPy metrics return them) and bools."""
    import numpy as np

    values = {"np_float32": np.float32(0.25), "np_int64": np.int64(3), "np_float64": np.float64(0.5), "flag": True,
              "plain_int": 7}

    class Numbers(Logs):
        def training_step(self, batch, batch_idx):
            self.log_dict(values, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    metrics = _fit(tmp_path, Numbers()).state.metrics
    assert {name: metrics[name] for name in values} == {name: float(v) for name, v in values.items()}


@pytest.mark.parametrize("value, shown", [
    ("0.5", "'0.5' (str())"),
    (torch.ones(2), "(Tensor(2,))"),
    (None, "None (NoneType())"),
])
def test_a_value_that_is_not_one_number_is_refused_naming_it(tmp_path, value, shown):
    class Bad(Logs):
        def training_step(self, batch, batch_idx):
            self.log("bad", value)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"self\.log\('bad', value\) takes a number, a one-element tensor or a "
                                         rf"torchmetrics Metric\. Received: .*{re.escape(shown)}\. Log a scalar"):
        _fit(tmp_path, Bad())


def test_log_dict_logs_each_item_with_the_options(tmp_path):
    class Dict(Logs):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log_dict({"c": 1.0, "d": torch.tensor(2.0)}, on_epoch=True, on_step=False)
            return loss

    metrics = _fit(tmp_path, Dict()).state.metrics
    assert (metrics["c"], metrics["d"]) == (1.0, 2.0)


def test_an_evaluation_value_is_weighted_by_the_given_batch_size(tmp_path):
    class Weighted(LogsAndReturns):
        def validation_step(self, batch, batch_idx):
            self.log("w", float(batch_idx), batch_size=1 if batch_idx == 0 else 3)

    trainer = Trainer(project_dir=tmp_path, enable_progress_bar=False)
    trainer.fit(Weighted(), make_loader(), make_loader())
    assert trainer.state.metrics["w"] == pytest.approx((0 * 1 + 1 * 3 + 2 * 3) / 7)
