"""What the tests of Lightning's loop arguments share (limits, sanity check, max_time, validation
schedule): the shared Regressor recording which samples each step saw, and exact-resume runs.

A dataset item is (x, y, index), so every test can say exactly which samples a loop read, in
which order; the model is support.models' Regressor, whose steps take (x, y).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint.run_folders import run_folder
from support.models import Regressor, regression_data


class Indexed(Dataset):
    """`regression_data(n)` with each sample's index as a third item."""

    def __init__(self, n: int = 16) -> None:
        self.x, self.y = regression_data(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def loader(n: int = 16, batch_size: int = 4, shuffle: bool = False, **kwargs: Any) -> DataLoader:
    """A DataLoader over `Indexed(n)`."""
    return DataLoader(Indexed(n), batch_size=batch_size, shuffle=shuffle, **kwargs)


class Recorder(Regressor):
    """The shared Regressor (its MSE loss); it records the sample indices of every training and validation step as
    (epoch, [indices]), and the validations' global steps."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[tuple[int, list[int]]] = []
        self.validated: list[tuple[int, list[int]]] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y, index = batch
        self.trained.append((self.trainer.state.epoch, index.tolist()))
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        x, y, index = batch
        self.validated.append((self.trainer.state.global_step, index.tolist()))
        return nn.functional.mse_loss(self(x), y)

    def predict_step(self, batch: Any) -> torch.Tensor:
        return self(batch[0])


def recorder(seed: int = 0) -> Recorder:
    torch.manual_seed(seed)
    return Recorder()


class CrashAt(Callback):
    """Raises in on_train_batch_end once optimizer step `step` was taken, after the callbacks before
    it (a Checkpointer) ran: an interrupted run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), f"{name} differs"


def resumed_run(tmp_path: pathlib.Path, make_trainer: Any, fit: Any, crash_at: int,
                resume_step: int) -> tuple[Trainer, Recorder, Recorder]:
    """Runs `fit(trainer, module)` with a checkpoint after every optimizer step, interrupted after step
    `crash_at`; then again, with another seed, from the checkpoint of step `resume_step`. Returns
    (the resumed trainer, the interrupted module, the resumed module).

    Args:
        make_trainer: `make_trainer(project_dir, callbacks, **kwargs)` builds each Trainer.
        fit: `fit(trainer, module)` fits it.
    """
    first = recorder()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(make_trainer(tmp_path, [Checkpointer(every_n_steps=1), CrashAt(crash_at)]), first)
    resumed_module = recorder(seed=123)
    checkpoint = run_folder(tmp_path) / f"checkpoint_{resume_step - 1}"  # the i-th save is step i + 1's
    trainer = make_trainer(tmp_path, [Checkpointer(every_n_steps=1)], resume_from=checkpoint)
    fit(trainer, resumed_module)
    return trainer, first, resumed_module
