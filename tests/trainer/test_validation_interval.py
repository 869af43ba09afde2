"""When fit validates with val_every_n_steps as an int or a fraction of an epoch, counted over the fit or
within val_every_n_epochs' epochs (fittrain/trainer/validation_schedule.py), checked against Lightning.

Epochs of 5 batches (20 samples in batches of 4) without accumulation, so optimizer steps are
batches and Lightning's `val_check_interval`/`check_val_every_n_epoch` must validate at the same steps.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from fittrain import Callback, Trainer
from loop_support import assert_same_parameters, loader, recorder, resumed_run


def validation_steps(tmp_path: pathlib.Path, epochs: int = 3, **kwargs: Any) -> list[int]:
    module = recorder()
    Trainer(project_dir=tmp_path, enable_progress_bar=False, max_epochs=epochs, **kwargs).fit(
        module, loader(n=20), loader(n=4))
    return [step for step, _ in module.validated]


# Lightning's (val_check_interval, check_val_every_n_epoch) -> the native arguments that express it. A
# fraction counted over the whole fit is fittrain's only (Lightning refuses a float with check_val_every_n_epoch=None).
MAPPING = [
    ((1.0, 1), {}, [5, 10, 15]),
    ((1.0, 2), {"val_every_n_epochs": 2}, [10]),
    ((0.5, 1), {"val_every_n_steps": 0.5, "val_every_n_epochs": 1}, [2, 4, 7, 9, 12, 14]),
    (None, {"val_every_n_steps": 0.5}, [2, 4, 6, 8, 10, 12, 14]),
    ((2, 1), {"val_every_n_steps": 2, "val_every_n_epochs": 1}, [2, 4, 7, 9, 12, 14]),
    ((2, 2), {"val_every_n_steps": 2, "val_every_n_epochs": 2}, [7, 9]),
    ((3, None), {"val_every_n_steps": 3}, [3, 6, 9, 12, 15]),
    (None, {"val_every_n_steps": 1.0}, [5, 10, 15]),
]


@pytest.mark.parametrize("lightning_args, kwargs, expected", MAPPING, ids=[str(m[0]) for m in MAPPING])
def test_validation_runs_after_these_steps(tmp_path, lightning_args, kwargs, expected):
    assert validation_steps(tmp_path, **kwargs) == expected


def test_lightning_validates_at_the_same_steps(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")

    class Boring(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)
            self.at: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if not self.trainer.sanity_checking and batch_idx == 0:
                self.at.append(self.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    for lightning_args, _, expected in MAPPING:
        if lightning_args is None:
            continue
        interval, every_n_epochs = lightning_args
        module = Boring()
        pl.Trainer(max_epochs=3, val_check_interval=interval, check_val_every_n_epoch=every_n_epochs,
                   accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path).fit(
            module, loader(n=20), loader(n=4))
        assert module.at == expected, (interval, every_n_epochs)


def test_a_fraction_counts_the_limited_epoch_and_accumulated_steps(tmp_path):
    # 5 batches of 8 trained, 3 optimizer steps an epoch (2, 2, 1 batches): 0.7 -> every int(2.1) = 2 steps.
    module = recorder()
    Trainer(project_dir=tmp_path, enable_progress_bar=False, max_epochs=2, limit_train_batches=5,
            gradient_accumulation_steps=2, val_every_n_steps=0.7, val_every_n_epochs=1).fit(
        module, loader(n=32), loader(n=4))
    assert [step for step, _ in module.validated] == [2, 5]


def test_steps_counted_within_epochs_resume_exactly(tmp_path):
    def make(project: pathlib.Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
        return Trainer(callbacks=callbacks, project_dir=project, enable_progress_bar=False, max_epochs=3,
                       val_every_n_steps=2, val_every_n_epochs=1, **kwargs)

    def fit(trainer: Trainer, module: Any) -> None:
        trainer.fit(module, loader(n=20, shuffle=True), loader(n=4))

    full_module = recorder()
    fit(make(tmp_path / "full", []), full_module)
    _, first, module = resumed_run(tmp_path / "cut", make, fit, crash_at=8, resume_step=6)  # epoch 1, batch 0
    assert [s for s, _ in first.validated if s <= 6] + [s for s, _ in module.validated] == \
        [s for s, _ in full_module.validated] == [2, 4, 7, 9, 12, 14]
    assert_same_parameters(module, full_module)


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(20):
            yield torch.randn(3), torch.randn(1), i


def test_what_could_never_validate_is_refused_when_fit_starts(tmp_path):
    with pytest.raises(ValueError, match=r"val_every_n_steps=6, val_every_n_epochs=1.*an epoch has 5 optimizer step"):
        validation_steps(tmp_path / "a", val_every_n_steps=6, val_every_n_epochs=1)
    with pytest.raises(ValueError, match=r"val_every_n_steps=0.5.*fraction of an epoch.*no length"):
        Trainer(project_dir=tmp_path / "b", val_every_n_steps=0.5, enable_progress_bar=False).fit(
            recorder(), DataLoader(Stream(), batch_size=4), loader(n=4))
    # A stream limited to n batches has epochs of n batches.
    module = recorder()
    Trainer(project_dir=tmp_path / "c", val_every_n_steps=0.5, limit_train_batches=4, max_epochs=1,
            enable_progress_bar=False).fit(module, DataLoader(Stream(), batch_size=4), loader(n=4))
    assert [s for s, _ in module.validated] == [2, 4]


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.5, float("nan"), True, "0.5"])
def test_bad_intervals_are_refused(bad):
    with pytest.raises(ValueError, match=rf"`Trainer\(val_every_n_steps=...\)` must be.*val_every_n_steps={bad!r}"):
        Trainer(val_every_n_steps=bad)


def test_a_checkpoint_from_before_epoch_start_step_counts_one_step_per_batch():
    from fittrain import TrainState

    state = TrainState()
    state.load_state_dict({"epoch": 1, "global_step": 7, "batch_idx": 2, "should_stop": False, "metrics": {}})
    assert state.epoch_start_step == 4 and state.time_trained == 0.0  # batches 0..2 of epoch 1 were steps 5..7
    state.epoch_start_step, state.timed_by = 5, lambda: 12.5
    assert {"epoch_start_step": 5, "time_elapsed": 12.5}.items() <= state.state_dict().items()
