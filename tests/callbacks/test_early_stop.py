"""EarlyStop: stops after exactly `patience` validations without improvement; mode, min_delta, NaN, state."""

from __future__ import annotations

import math

import pytest

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer, EarlyStop


class EpochCounter(Callback):
    """Counts the epochs a fit trained."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_train_epoch_start(self, trainer: Trainer) -> None:
        self.epochs += 1


def _fit(make_module, make_loader, tmp_path, val_losses, stopper, max_epochs=None, **trainer_kwargs):
    """Fits with validation_step returning val_losses[epoch]; returns how many epochs ran."""
    counter = EpochCounter()
    trainer = Trainer(project_dir=tmp_path, max_epochs=max_epochs or len(val_losses), callbacks=[stopper, counter],
                      **trainer_kwargs)
    trainer.fit(make_module(val_losses=val_losses), make_loader(batch_size=8), make_loader(batch_size=8))
    return counter.epochs


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_stops_after_exactly_patience_validations_without_improvement(make_module, make_loader, tmp_path, patience):
    # Best at epoch 1; then nothing improves, although later values would (epoch 7).
    losses = [1.0, 0.5, 0.7, 0.5, 0.6, 0.9, 0.8, 0.1]
    stopper = EarlyStop(patience=patience)
    epochs = _fit(make_module, make_loader, tmp_path, losses, stopper)
    assert epochs == 2 + patience
    assert stopper.stopped_epoch == 1 + patience
    assert stopper.best == pytest.approx(0.5) and stopper.wait == patience


def test_an_improvement_resets_the_count(make_module, make_loader, tmp_path):
    losses = [1.0, 1.1, 0.9, 1.2, 0.8, 1.3, 1.4, 0.1]
    assert _fit(make_module, make_loader, tmp_path, losses, EarlyStop(patience=2)) == 7


def test_mode_max(make_module, make_loader, tmp_path):
    # An equal value is no improvement: epoch 4 repeats the best of epoch 2.
    scores = [0.1, 0.2, 0.3, 0.25, 0.3, 0.9]
    stopper = EarlyStop(monitor="val_loss", mode="max", patience=2)
    assert _fit(make_module, make_loader, tmp_path, scores, stopper) == 5
    assert stopper.best == pytest.approx(0.3)


@pytest.mark.parametrize("min_delta, epochs", [(0.0, 4), (0.1, 3)])
def test_min_delta(make_module, make_loader, tmp_path, min_delta, epochs):
    # Each epoch improves by less than 0.1, so with min_delta=0.1 none of them counts.
    losses = [1.0, 0.95, 0.91, 0.87]
    assert _fit(make_module, make_loader, tmp_path, losses, EarlyStop(patience=2, min_delta=min_delta)) == epochs


def test_nan_stops_at_once_with_a_warning(make_module, make_loader, tmp_path):
    stopper = EarlyStop(patience=3)
    with pytest.warns(UserWarning, match=r"val_loss=nan is not finite"):
        epochs = _fit(make_module, make_loader, tmp_path, [1.0, math.nan, 0.5, 0.4], stopper)
    assert epochs == 2 and stopper.stopped_epoch == 1


def test_nan_without_check_finite_counts_as_no_improvement(make_module, make_loader, tmp_path):
    stopper = EarlyStop(patience=2, check_finite=False)
    assert _fit(make_module, make_loader, tmp_path, [1.0, math.nan, math.inf, 0.5], stopper) == 3
    assert stopper.best == 1.0


def test_missing_monitor_lists_the_metrics_that_exist(make_module, make_loader, tmp_path):
    with pytest.raises(ValueError, match=r"monitor='val_acc'") as info:
        _fit(make_module, make_loader, tmp_path, [1.0, 0.5], EarlyStop(monitor="val_acc"))
    assert "['train_loss', 'val_loss']" in str(info.value)
    assert any("EarlyStop.on_validation_end" in note for note in info.value.__notes__)


def test_warns_when_no_validation_ran(make_module, make_loader, tmp_path):
    trainer = Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[EarlyStop()])
    with pytest.warns(UserWarning, match="never ran"):
        trainer.fit(make_module(), make_loader())


def test_state_round_trip():
    stopper = EarlyStop(patience=5)
    stopper.best, stopper.wait = 0.25, 3
    restored = EarlyStop(patience=5)
    restored.load_state_dict(stopper.state_dict())
    assert (restored.best, restored.wait) == (0.25, 3)


def test_state_resets_at_fit_start(make_module, make_loader, tmp_path):
    stopper = EarlyStop(patience=2)
    _fit(make_module, make_loader, tmp_path / "a", [0.1, 0.2, 0.3, 0.4], stopper)
    # Reused for a fit whose losses are all worse than the old best: it must start afresh.
    assert _fit(make_module, make_loader, tmp_path / "b", [5.0, 4.0, 3.0, 2.0], stopper) == 4


def test_resume_continues_the_count(make_module, make_loader, tmp_path):
    losses = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]
    first = Trainer(project_dir=tmp_path, max_epochs=2,
                    callbacks=[EarlyStop(patience=3), Checkpointer(every_n_epochs=1)])
    first.fit(make_module(val_losses=losses), make_loader(batch_size=8), make_loader(batch_size=8))
    # The checkpoint holds best=1.0, wait=1: two more validations without improvement stop training.
    stopper, counter = EarlyStop(patience=3), EpochCounter()
    second = Trainer(project_dir=tmp_path, max_epochs=8, resume_from="latest", callbacks=[stopper, counter])
    second.fit(make_module(val_losses=losses), make_loader(batch_size=8), make_loader(batch_size=8))
    assert counter.epochs == 2 and stopper.stopped_epoch == 3
    assert (stopper.best, stopper.wait) == (1.0, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "sideways"}, "`EarlyStop(mode=...)` must be 'min' or 'max'. Received: mode='sideways'."),
    ({"patience": 0}, "Received: patience=0."),
    ({"patience": 1.5}, "Received: patience=1.5."),
    ({"min_delta": -1}, "Received: min_delta=-1."),
    ({"min_delta": math.nan}, "Received: min_delta=nan."),
    ({"monitor": ""}, "Received: monitor=''."),
    ({"check_finite": "yes"}, "Received: check_finite='yes'."),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        EarlyStop(**kwargs)
    assert message in str(info.value)
