"""`Trainer(max_time=...)`: training stops once that much wall time has passed (Lightning's Timer).

The time counts from when training starts (after setup, the resumed checkpoint's loading and
the sanity check: Lightning's `on_train_start`), plus the training time a resumed checkpoint had
already spent, which every checkpoint records (`TrainState`'s "time_elapsed"): a preempted run
gets the rest of its budget, not a new one. It is checked after every optimizer step (the end of
each accumulation window), after `on_train_batch_end`, as Lightning's Timer checks after every
batch; once passed, training stops as `trainer.state.should_stop` stops it in the middle of an
epoch: that step is the last, the epoch's end (its validation, `on_train_epoch_end`, a
Checkpointer's epoch-end save) and the fit's end events still run. A resumed run whose budget is
spent trains nothing.

With several processes the main process's clock decides, broadcast in one small collective per
check, so every process stops after the same step. Without `max_time` there is no Timer and
nothing is checked.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from fittrain.common.checks import ArgumentTypeError
from fittrain.common.reprs import short_repr
from fittrain.trainer.progress import say

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

_FORMS = ('None, a "DD:HH:MM:SS" string (such as "00:12:00:00" for 12 hours), a datetime.timedelta, or a dict of '
          "timedelta's keywords (such as {'hours': 12})")
_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


def parse_max_time(value: Any) -> float | None:
    """`max_time` in seconds (None: no limit), from Lightning's forms: "DD:HH:MM:SS", a timedelta, a dict
    of timedelta keywords.

    Raises:
        ArgumentTypeError: for another type.
        ValueError: for a string not in that format, a dict timedelta refuses, or a negative duration.
    """
    if value is None:
        return None
    if isinstance(value, str):
        match = _DURATION.fullmatch(value.strip())
        if not match:
            raise ValueError(f"`Trainer(max_time=...)` must be {_FORMS}. Received: max_time={value!r}, which is not "
                             "DD:HH:MM:SS (days, then two digits each for hours, minutes and seconds).")
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        value = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, dict):
        try:
            value = datetime.timedelta(**value)
        except TypeError as err:
            raise ValueError(f"`Trainer(max_time=...)` must be {_FORMS}. Received: max_time={short_repr(value)}, "
                             f"which timedelta refuses: {err}.") from None
    if not isinstance(value, datetime.timedelta):
        raise ArgumentTypeError(f"`Trainer(max_time=...)` must be {_FORMS}. Received: max_time={short_repr(value)} "
                                f"({type(value).__name__}).")
    if value < datetime.timedelta(0):
        raise ValueError(f"`Trainer(max_time=...)` must not be negative. Received: max_time={value!r}.")
    return value.total_seconds()


class Timer:
    """Measures the fit's training time and stops training once `seconds` have passed.

    Args:
        seconds: The budget (`max_time`, parsed).
        clock: Returns the time in seconds; `time.monotonic` (tests give a clock of their own).

    Attributes:
        seconds, clock: As given.
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self._started = 0.0
        self._offset = 0.0

    def start(self, trainer: "Trainer") -> None:
        """Starts counting (training starts now) on top of what a resumed checkpoint had trained, and
        lets checkpoints record the time; a budget spent already stops training before its first step."""
        state = trainer.state
        self._offset, self._started = state.time_trained, self.clock()
        state.timed_by = self.elapsed
        self.check(trainer)

    def elapsed(self) -> float:
        """Seconds of training so far, a resumed run's earlier time included."""
        return self._offset + self.clock() - self._started

    def check(self, trainer: "Trainer") -> bool:
        """Whether the budget is spent (the main process's answer, on every process); if so, sets
        `trainer.state.should_stop`. One broadcast with several processes."""
        acc = trainer.accelerator
        spent = self.elapsed() >= self.seconds
        if acc.num_processes > 1:
            spent = bool(acc.broadcast(torch.tensor([spent], device=acc.device)).item())
        if spent and not trainer.state.should_stop:
            trainer.state.should_stop = True
            say(trainer, f"max_time reached: {datetime.timedelta(seconds=int(self.elapsed()))} of training (limit "
                         f"{datetime.timedelta(seconds=self.seconds)}); stopping after optimizer step "
                         f"{trainer.state.global_step}.")
        return spent

    def __repr__(self) -> str:
        return f"Timer(seconds={self.seconds})"
