"""Trainer(max_time=...): training stops once that much time has trained, in one process.

No test depends on the machine's speed: each gives the Trainer's Timer a clock of its own,
which reads the training's progress (10 "seconds" per optimizer step, or per batch), so the
step at which the budget is spent is known exactly. The 2-process test is in test_loop_args_ddp.py.
"""

from __future__ import annotations

import datetime
import pathlib
from typing import Any

import pytest

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint.run_folders import run_folder
from fittrain.trainer.timer import parse_max_time
from loop_support import CrashAt, assert_same_parameters, loader, recorder


def ten_per_step(trainer: Trainer) -> Any:
    """A clock at which every optimizer step takes 10 seconds."""
    return lambda: 10.0 * trainer.state.global_step


def timed(tmp_path: pathlib.Path, callbacks: list[Callback] | None = None, **kwargs: Any) -> Trainer:
    kwargs.setdefault("enable_progress_bar", False)
    fit = Trainer(callbacks=callbacks, project_dir=tmp_path, **kwargs)
    fit.timer.clock = ten_per_step(fit)
    return fit


class Ends(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_validation_end(self, trainer: Trainer) -> None:
        self.seen.append(("validation", trainer.state.global_step))

    def on_train_epoch_end(self, trainer: Trainer) -> None:
        self.seen.append(("epoch_end", trainer.state.global_step))

    def on_fit_end(self, trainer: Trainer) -> None:
        self.seen.append(("fit_end", trainer.state.global_step))


@pytest.mark.parametrize("value, seconds", [
    ("00:12:00:00", 12 * 3600), ("1:00:00:30", 86430), (" 00:00:01:05 ", 65),
    (datetime.timedelta(minutes=3), 180), ({"hours": 1, "minutes": 30}, 5400), ({"weeks": 1}, 604800),
    ("00:00:00:00", 0), (None, None)])
def test_lightnings_forms_are_parsed(value, seconds):
    assert parse_max_time(value) == seconds


@pytest.mark.parametrize("bad, error, fragment", [
    ("12:00:00", ValueError, "not DD:HH:MM:SS"), ("00:1:00:00", ValueError, "not DD:HH:MM:SS"),
    ({"hourz": 1}, ValueError, "which timedelta refuses"), (datetime.timedelta(seconds=-1), ValueError, "negative"),
    (3600, TypeError, "(int)"), (True, TypeError, "(bool)"), (1.5, TypeError, "(float)")])
def test_bad_max_time_is_refused_at_construction(bad, error, fragment):
    with pytest.raises(error, match=r"`Trainer\(max_time=...\)` must") as info:
        Trainer(max_time=bad)
    assert fragment in str(info.value)


def test_training_stops_after_the_step_that_spent_the_budget_and_ends_as_a_stop_does(tmp_path, capsys):
    ends, module = Ends(), recorder()
    fit = timed(tmp_path, [ends, Checkpointer(every_n_epochs=1)], max_epochs=5, max_time={"seconds": 25},
                enable_progress_bar=True)
    fit.fit(module, loader(), loader())
    # Step 3 reads 30 s >= 25 s: the epoch ends there, with its validation and a Checkpointer's epoch-end save.
    assert fit.state.global_step == 3 and fit.state.should_stop and len(module.trained) == 3
    assert ends.seen == [("validation", 3), ("epoch_end", 3), ("fit_end", 3)]
    assert [p.name for p in sorted(run_folder(tmp_path).iterdir())] == ["checkpoint_0", "run.json"]
    assert "max_time reached: 0:00:30 of training (limit 0:00:25); stopping after optimizer step 3." in \
        capsys.readouterr().out


def test_given_alone_it_leaves_epochs_unlimited(tmp_path):
    fit = timed(tmp_path, max_time="00:00:01:35")  # 95 s: 10 steps, 2.5 epochs of 4 steps
    fit.fit(recorder(), loader())
    assert fit.max_epochs is None and fit.state.global_step == 10 and fit.state.epoch == 3


def test_it_is_checked_at_the_end_of_accumulation_windows(tmp_path):
    batches = []

    class Count(Callback):
        def on_train_batch_end(self, trainer: Trainer) -> None:
            batches.append(trainer.state.global_step)

    fit = Trainer(callbacks=[Count()], project_dir=tmp_path, enable_progress_bar=False, max_epochs=3,
                  max_time={"seconds": 25}, gradient_accumulation_steps=2)
    fit.timer.clock = lambda: 10.0 * len(batches)  # 10 s a batch: spent after batch 3, mid-window
    fit.fit(recorder(), loader())
    assert batches == [0, 1, 1, 2] and fit.state.global_step == 2  # the window's step finished first


def _timed(tmp_path: pathlib.Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    kwargs.setdefault("max_time", {"seconds": 65})
    return timed(tmp_path, callbacks, max_epochs=5, **kwargs)


def test_a_resumed_run_gets_the_rest_of_its_budget(tmp_path):
    full_module = recorder()
    full = _timed(tmp_path / "full", [])
    full.fit(full_module, loader(shuffle=True))
    assert full.state.global_step == 7  # 70 s >= 65 s
    with pytest.raises(RuntimeError, match="simulated crash"):
        _timed(tmp_path / "cut", [Checkpointer(every_n_steps=1), CrashAt(5)]).fit(recorder(), loader(shuffle=True))
    module = recorder(seed=123)
    resumed = _timed(tmp_path / "cut", [], resume_from=run_folder(tmp_path / "cut") / "checkpoint_3")  # step 4
    # The resumed process's clock starts at 40 s (step 4): only the checkpoint's recorded time keeps it at 7.
    resumed.fit(module, loader(shuffle=True))
    assert resumed.state.global_step == 7 and len(module.trained) == 3
    assert_same_parameters(module, full_module)


def test_a_resumed_run_whose_budget_is_spent_trains_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _timed(tmp_path, [Checkpointer(every_n_steps=1), CrashAt(8)], max_time={"hours": 1}).fit(recorder(), loader())
    module = recorder()
    resumed = _timed(tmp_path, [], resume_from=run_folder(tmp_path) / "checkpoint_6")  # step 7 recorded 70 s
    resumed.fit(module, loader())
    assert module.trained == [] and resumed.state.global_step == 7


def test_without_max_time_there_is_no_timer_and_no_time_in_checkpoints(tmp_path):
    fit = Trainer(project_dir=tmp_path, enable_progress_bar=False)
    fit.fit(recorder(), loader())
    assert fit.timer is None and "time_elapsed" not in fit.state.state_dict()
