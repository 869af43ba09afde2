"""Step-based validation (`Trainer(val_every_n_steps=...)`) and train loaders without a length.

Real Trainer runs on the CPU: 16 samples in batches of 4, so an epoch is 4 batches (4 optimizer
steps without accumulation). Validations are recorded from a callback in `on_validation_end`.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, EarlyStop, Logger
from fittrain.checkpoint.run_folders import run_folder
from fittrain.trainer.evaluation import check_fit_inputs
from fittrain.trainer.parts import length_of


class Regressor(TrainModule):
    """Linear regression; `val_loss` makes validation_step return that constant instead."""

    def __init__(self, val_loss: float | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.val_loss = val_loss
        self.trained_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        self.trained_batches += 1
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        if self.val_loss is not None:
            return torch.tensor(self.val_loss)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def make_module(seed: int = 0, **kwargs: Any) -> Regressor:
    torch.manual_seed(seed)
    return Regressor(**kwargs)


class Samples(Dataset):
    """16 fixed regression samples; `size` may be changed between epochs (a source that runs dry)."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5]])
        self.size = n

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_loader(shuffle: bool = False, dataset: Dataset | None = None) -> DataLoader:
    return DataLoader(dataset if dataset is not None else Samples(), batch_size=4, shuffle=shuffle)


class Validations(Callback):
    """Records (global_step, epoch, batch_idx) at each validation and the order of a few events."""

    def __init__(self) -> None:
        self.at: list[tuple[int, int, int]] = []
        self.events: list[str] = []

    def on_validation_end(self, trainer: Trainer) -> None:
        state = trainer.state
        self.at.append((state.global_step, state.epoch, state.batch_idx))
        self.events.append("on_validation_end")

    def on_train_batch_end(self, trainer: Trainer) -> None:
        self.events.append("on_train_batch_end")

    def on_train_epoch_end(self, trainer: Trainer) -> None:
        self.events.append("on_train_epoch_end")

    def on_fit_end(self, trainer: Trainer) -> None:
        self.events.append("on_fit_end")

    @property
    def steps(self) -> list[int]:
        return [step for step, _, _ in self.at]


class CrashAt(Callback):
    """Raises in on_train_batch_end at `step`, after the callbacks before it (a Checkpointer) ran."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


# ----------------------------------------------------------------- when validation runs
@pytest.mark.parametrize("kwargs, expected", [
    # 3 epochs x 4 steps; step 12 ends the last epoch and is validated once, not twice.
    ({"val_every_n_steps": 3}, [(3, 0, 2), (6, 1, 1), (9, 2, 0), (12, 2, 3)]),
    ({"val_every_n_steps": 4}, [(4, 0, 3), (8, 1, 3), (12, 2, 3)]),
    # With accumulation, optimizer steps count (2 per epoch), not batches.
    ({"val_every_n_steps": 1, "gradient_accumulation_steps": 2}, [(1, 0, 1), (2, 0, 3), (3, 1, 1), (4, 1, 3),
                                                                    (5, 2, 1), (6, 2, 3)]),
    # Neither argument: every epoch end, as before; val_every_n_epochs alone keeps working.
    ({}, [(4, 0, 3), (8, 1, 3), (12, 2, 3)]),
    ({"val_every_n_epochs": 2}, [(8, 1, 3)]),
])
def test_validation_runs_at_these_steps(tmp_path, kwargs, expected):
    seen = Validations()
    Trainer(callbacks=[seen], max_epochs=3, project_dir=tmp_path, **kwargs).fit(make_module(), make_loader(),
                                                                                 make_loader())
    assert seen.at == expected


def test_step_validation_runs_after_the_step_and_before_on_train_batch_end(tmp_path):
    seen = Validations()
    trainer = Trainer(callbacks=[seen], max_epochs=1, val_every_n_steps=2, project_dir=tmp_path)
    assert (trainer.val_every_n_epochs, trainer.val_every_n_steps) == (None, 2)
    trainer.fit(make_module(), make_loader(), make_loader())
    batch, validation = "on_train_batch_end", "on_validation_end"
    assert seen.events == [batch, validation, batch, batch, validation, batch, "on_train_epoch_end", "on_fit_end"]
    assert Trainer().val_every_n_epochs == 1 and Trainer().val_every_n_steps is None


def test_without_val_loader_step_validation_does_nothing(tmp_path):
    seen = Validations()
    trainer = Trainer(callbacks=[seen], max_epochs=1, val_every_n_steps=1, project_dir=tmp_path)
    trainer.fit(make_module(), make_loader())
    assert seen.at == [] and trainer.state.global_step == 4


# ----------------------------------------------------------------- early stopping mid-epoch
def test_early_stop_after_a_mid_epoch_validation_stops_after_that_batch(tmp_path):
    # A constant val_loss never improves: best at step 2, then waits at 4 and 6 -> stop at step 6,
    # the second batch of epoch 1.
    seen, stopper = Validations(), EarlyStop(patience=2)
    module = make_module(val_loss=1.0)
    trainer = Trainer(callbacks=[stopper, seen], max_epochs=5, val_every_n_steps=2, project_dir=tmp_path)
    trainer.fit(module, make_loader(), make_loader())
    assert seen.steps == [2, 4, 6]
    assert trainer.state.global_step == 6 and module.trained_batches == 6
    assert trainer.state.should_stop and stopper.stopped_epoch == 1 and stopper.wait == 2
    # The stop ends the epoch after that batch's on_train_batch_end; epoch end and fit end still run.
    assert seen.events[-4:] == ["on_validation_end", "on_train_batch_end", "on_train_epoch_end", "on_fit_end"]
    assert trainer.state.epoch == 2


# ----------------------------------------------------------------- exact resume
def _resume_run(tmp_path: pathlib.Path, *callbacks: Callback, **kwargs: Any) -> tuple[Trainer, Regressor]:
    module = make_module(seed=kwargs.pop("seed", 0))
    trainer = Trainer(callbacks=list(callbacks), max_epochs=3, val_every_n_steps=3, project_dir=tmp_path, **kwargs)
    trainer.fit(module, make_loader(shuffle=True), make_loader())
    return trainer, module


def test_resume_after_a_mid_epoch_validation_is_exact_and_does_not_validate_again(tmp_path):
    full_seen, full_stop = Validations(), EarlyStop(patience=100)
    full, full_module = _resume_run(tmp_path / "full", full_stop, Checkpointer(every_n_steps=3), full_seen)

    # Crash right after the checkpoint of step 6, which follows the validation of step 6 (epoch 1, batch 1).
    first_seen = Validations()
    with pytest.raises(RuntimeError, match="simulated crash"):
        _resume_run(tmp_path / "cut", EarlyStop(patience=100), Checkpointer(every_n_steps=3), first_seen, CrashAt(6))
    assert first_seen.steps == [3, 6]
    checkpoint = run_folder(tmp_path / "cut") / "checkpoint_1"
    assert checkpoint.is_dir()

    resumed_seen, resumed_stop = Validations(), EarlyStop(patience=100)
    resumed, resumed_module = _resume_run(tmp_path / "cut", resumed_stop, Checkpointer(every_n_steps=3), resumed_seen,
                                          resume_from=checkpoint, seed=123)
    assert resumed_seen.steps == [9, 12]  # step 6's validation is not run again
    assert first_seen.steps + resumed_seen.steps == full_seen.steps == [3, 6, 9, 12]
    assert resumed_module.trained_batches == 6  # the rest of epoch 1, then epoch 2
    for a, b in zip(full_module.parameters(), resumed_module.parameters()):
        assert torch.equal(a, b)
    assert resumed.state.global_step == full.state.global_step == 12
    assert (resumed_stop.best, resumed_stop.wait) == (full_stop.best, full_stop.wait)
    assert resumed.state.metrics["val_loss"] == full.state.metrics["val_loss"]


# ----------------------------------------------------------------- logging
def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_logger_writes_val_loss_at_mid_epoch_steps(tmp_path):
    values: list[float] = []

    class Keep(Callback):
        def on_validation_end(self, trainer: Trainer) -> None:
            values.append(trainer.state.metrics["val_loss"])

    logger = Logger(every_n_steps=100, progress_bar=False, run_name="run")
    Trainer(callbacks=[logger, Keep()], max_epochs=2, val_every_n_steps=3, project_dir=tmp_path).fit(
        make_module(), make_loader(), make_loader())
    scalars = _scalars(tmp_path / "logs" / "run")
    assert [step for step, _ in scalars["val_loss"]] == [3, 6]  # no point at the epoch ends (4, 8)
    assert [value for _, value in scalars["val_loss"]] == pytest.approx(values, rel=1e-6)
    # The training metrics are written before each validation and at the end of the fit.
    assert [step for step, _ in scalars["train_loss"]] == [3, 6, 8]


# ----------------------------------------------------------------- bad arguments
def test_bad_step_intervals_are_refused_naming_the_value():
    # (Both intervals together count steps within those epochs: tests/trainer/test_validation_interval.py.)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"val_every_n_steps={bad!r}"):
            Trainer(val_every_n_steps=bad)


# ----------------------------------------------------------------- loaders without a length
class Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


class SizedStream(Stream):
    def __len__(self) -> int:
        return 8


def test_length_of_treats_a_stream_as_having_no_length():
    assert length_of(make_loader()) == 4
    assert length_of([1, 2, 3]) == 3
    assert length_of(DataLoader(Stream(), batch_size=2)) is None
    assert length_of(DataLoader(SizedStream(), batch_size=2)) is None  # a hint, not a count of batches

    class Unknown:
        def __iter__(self):
            return iter(())

        def __len__(self):
            raise TypeError("length unknown")

    assert length_of(Unknown()) is None
    # fit's input check does not call len() on a stream's loader.
    check_fit_inputs(make_module(), DataLoader(Stream(), batch_size=2), None)


def test_an_epoch_without_any_batch_is_refused_instead_of_looping(tmp_path):
    data = Samples()

    class RunDry(Callback):
        """Empties the source after the first pass, like a stream that cannot start over."""

        def on_train_epoch_end(self, trainer: Trainer) -> None:
            data.size = 0
            if trainer.state.epoch > 5:  # without the check, max_steps alone would never end
                raise RuntimeError("empty epochs kept running")

    trainer = Trainer(callbacks=[RunDry()], max_steps=100, project_dir=tmp_path)
    with pytest.raises(ValueError, match=r"`train_loader` yielded no batch in epoch 1") as info:
        trainer.fit(make_module(), make_loader(dataset=data))
    assert "train_loader=<DataLoader>" in str(info.value) and "__iter__" in str(info.value)
    assert trainer.state.global_step == 4
