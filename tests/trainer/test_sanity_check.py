"""Trainer(num_sanity_val_steps=n): Lightning's sanity check before training, in one process.

16 indexed samples in batches of 4; the shared Regressor recording what each step read
(loop_support.py).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from fittrain import Callback, Trainer
from fittrain.trainer.events import Event
from loop_support import Recorder, assert_same_parameters, loader, recorder, resumed_run


def _recording(name: str) -> Any:
    def hook(self: "Events", trainer: Trainer) -> None:
        self.seen.append((name, trainer.sanity_checking))
        if name == "on_train_start":
            self.metrics_at_train_start = dict(trainer.state.metrics)
    return hook


class Events(Callback):
    """Records every event's name (each hook is defined on the class below), with whether
    trainer.sanity_checking was set."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.metrics_at_train_start: dict[str, float] | None = None

    def names(self, until: str = "on_train_start") -> list[str]:
        names = [name for name, _ in self.seen]
        return names[:names.index(until) + 1]


for _event in Event:
    if _event is not Event.EXCEPTION:
        setattr(Events, _event.value, _recording(_event.value))


class LogsAtEpochEnd(Recorder):
    """Logs a metric in on_validation_epoch_end, as Lightning programs do; counts the module hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_ends: list[bool] = []

    def on_validation_epoch_end(self) -> None:
        self.epoch_ends.append(self.trainer.sanity_checking)
        self.log("val_marker", 1.0)


def trainer(tmp_path: pathlib.Path, callbacks: list[Callback] | None = None, **kwargs: Any) -> Trainer:
    kwargs.setdefault("enable_progress_bar", False)
    return Trainer(callbacks=callbacks, project_dir=tmp_path, **kwargs)


def test_it_runs_between_on_fit_start_and_on_train_start_with_lightnings_hooks(tmp_path):
    events, module = Events(), LogsAtEpochEnd()
    fit = trainer(tmp_path, [events], num_sanity_val_steps=2)
    fit.fit(module, loader(), loader())
    assert events.names() == ["on_fit_start", "on_sanity_check_start", "on_validation_start",
                              "on_validation_batch_start", "on_validation_batch_end",
                              "on_validation_batch_start", "on_validation_batch_end",
                              "on_validation_end", "on_sanity_check_end", "on_train_start"]
    # sanity_checking is set from on_sanity_check_start to on_sanity_check_end, both included (Lightning's).
    flags = [flag for _, flag in events.seen]
    assert flags[1:9] == [True] * 8 and not flags[0] and not any(flags[9:])
    assert module.epoch_ends == [True, False]  # the module's validation hooks run in it too
    assert [ids for _, ids in module.validated[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fit.num_sanity_val_batches == 2


def test_its_metrics_are_discarded(tmp_path):
    events, module = Events(), LogsAtEpochEnd()
    fit = trainer(tmp_path, [events], num_sanity_val_steps=1)
    fit.fit(module, loader(), loader())
    assert events.metrics_at_train_start == {}  # neither val_loss nor what on_validation_epoch_end logged
    assert {"val_loss", "val_marker", "train_loss"} <= set(fit.state.metrics)  # the real validation's


def test_training_draws_the_same_numbers_with_or_without_it(tmp_path):
    # The val loader shuffles from the global RNG: without the RNG put back, the first epoch's order would change.
    modules, orders = [], []
    for steps in (0, 3):
        module = recorder()
        trainer(tmp_path / str(steps), num_sanity_val_steps=steps, max_epochs=2).fit(
            module, loader(shuffle=True), loader(shuffle=True))
        modules.append(module)
        orders.append(module.trained)
    assert orders[0] == orders[1]
    assert_same_parameters(modules[0], modules[1])
    assert len(modules[1].validated) == len(modules[0].validated) + 3


@pytest.mark.parametrize("steps, limit, expected", [(10, None, 4), (-1, None, 4), (-1, 2, 2), (3, 2, 2), (1, 2, 1)])
def test_it_runs_at_most_the_limited_val_loader(tmp_path, steps, limit, expected):
    module = recorder()
    fit = trainer(tmp_path, num_sanity_val_steps=steps, limit_val_batches=limit, limit_train_batches=0)
    fit.fit(module, loader(), loader())
    assert len(module.validated) == expected == fit.num_sanity_val_batches


def test_a_broken_validation_step_fails_before_any_training(tmp_path):
    class Broken(Recorder):
        def validation_step(self, batch: Any) -> torch.Tensor:
            raise KeyError("typo in validation_step")

    module = Broken()
    with pytest.raises(KeyError, match="typo in validation_step"):
        trainer(tmp_path, num_sanity_val_steps=1).fit(module, loader(), loader())
    assert module.trained == []


@pytest.mark.parametrize("kwargs", [{}, {"limit_val_batches": 0}, {"fast_dev_run": True}],
                         ids=["no-val-loader", "limit-val-0", "fast-dev-run"])
def test_it_does_not_run_without_validation(tmp_path, kwargs):
    events = Events()
    val = None if not kwargs else loader()
    trainer(tmp_path, [events], num_sanity_val_steps=2, **kwargs).fit(recorder(), loader(), val)
    assert "on_sanity_check_start" not in [name for name, _ in events.seen]
    assert events.names()[-2:] == ["on_fit_start", "on_train_start"]


def _sanity(tmp_path: pathlib.Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    return trainer(tmp_path, callbacks, max_epochs=2, num_sanity_val_steps=2, **kwargs)


def _fit(fit: Trainer, module: Any) -> None:
    fit.fit(module, loader(shuffle=True), loader(shuffle=True))


def test_a_resumed_fit_skips_it_and_ends_bitwise_as_the_uninterrupted_one(tmp_path):
    full_module = recorder()
    full = _sanity(tmp_path / "full", [])
    _fit(full, full_module)
    resumed, first, module = resumed_run(tmp_path / "cut", _sanity, _fit, crash_at=6, resume_step=5)
    assert_same_parameters(module, full_module)
    assert first.trained[:5] + module.trained == full_module.trained
    assert resumed.num_sanity_val_batches == 0
    assert module.validated == full_module.validated[-len(module.validated):]  # only the epoch-end validation
    assert len(module.validated) == 4


@pytest.mark.parametrize("bad", [-2, True, 1.5, None, "2"])
def test_bad_num_sanity_val_steps_is_refused(bad):
    with pytest.raises(ValueError, match=r"`Trainer\(num_sanity_val_steps=...\)` must be an int >= -1"):
        Trainer(num_sanity_val_steps=bad)


def test_the_progress_bar_says_sanity_checking(tmp_path, capsys):
    Trainer(project_dir=tmp_path, num_sanity_val_steps=2).fit(recorder(), loader(), loader())
    err = capsys.readouterr().err
    assert "Sanity Checking" in err and "Validation" in err
