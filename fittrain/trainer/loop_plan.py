"""The Trainer's loop plan: how long fit trains, how many batches each loop runs, when fit validates.

`loop_lengths` checks `max_epochs`, `max_steps` and the validation intervals when the Trainer is
built, and lets `fast_dev_run` override them. A `LoopPlan` (the Trainer's `loops`) then decides,
once per fit (`plan_fit`) and per evaluation call (`eval_limit`), the batches each loop runs
under the limits (fittrain/trainer/limits.py), the sanity check's, and the validation schedule
(fittrain/trainer/validation_schedule.py); the Trainer publishes the counts under Lightning's
names (`num_training_batches`, `num_val_batches`, ...: an int, or inf for a stream).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from fittrain.common.checks import check_positive_int
from fittrain.trainer.limits import LoopLimits, batches_to_run, counted, sequential_loader
from fittrain.trainer.validation_schedule import (
    ValidationSchedule,
    check_validation_interval,
    steps_per_epoch,
    validation_schedule,
)


@dataclasses.dataclass(frozen=True)
class LoopLengths:
    """How long fit trains and when it validates, checked (see `loop_lengths`).

    Attributes:
        max_epochs, max_steps, val_every_n_epochs, val_every_n_steps: The Trainer's values.
        overridden: The arguments given that fast_dev_run overrode, as "name=value", for its line.
    """

    max_epochs: int | None
    max_steps: int | None
    val_every_n_epochs: int | None
    val_every_n_steps: int | float | None
    overridden: tuple[str, ...] = ()


def loop_lengths(limits: LoopLimits, timed: bool, max_epochs: Any, max_steps: Any, val_every_n_epochs: Any,
                 val_every_n_steps: Any) -> LoopLengths:
    """Checks the Trainer's lengths; with none of max_epochs, max_steps and max_time (`timed`) one epoch
    trains. `fast_dev_run` overrides them: one epoch of at most n steps, validated at its end.

    Raises:
        ValueError: for a bad value (see check_positive_int and check_validation_interval).
    """
    max_epochs = check_positive_int("max_epochs", max_epochs, optional=True)
    max_steps = check_positive_int("max_steps", max_steps, optional=True)
    every_n_epochs, every_n_steps = check_validation_interval(val_every_n_epochs, val_every_n_steps)
    if limits.dev_run:
        given = {"max_epochs": max_epochs, "max_steps": max_steps, "val_every_n_epochs": val_every_n_epochs,
                 "val_every_n_steps": val_every_n_steps}
        overridden = tuple(f"{name}={value!r}" for name, value in given.items() if value is not None)
        return LoopLengths(1, limits.dev_run, 1, None, overridden)
    if max_epochs is None and max_steps is None and not timed:
        max_epochs = 1
    return LoopLengths(max_epochs, max_steps, every_n_epochs, every_n_steps)


class LoopPlan:
    """The batches each loop of one Trainer runs, and when its fit validates.

    Args:
        limits: The Trainer's resolved limits.

    Attributes:
        train, val, sanity: This fit's limits (None: every batch); `sanity` 0 when there is no sanity check.
        num_training_batches, num_val_batches, num_sanity_val_batches, num_test_batches,
            num_predict_batches: Lightning's counts of the last planned loops (inf: a stream).
        schedule: When this fit validates.
    """

    def __init__(self, limits: LoopLimits) -> None:
        self.limits = limits
        self.train: int | None = None
        self.val: int | None = None
        self.sanity: int | None = 0
        self.num_training_batches: int | float = math.inf
        self.num_val_batches: int | float = 0
        self.num_sanity_val_batches: int | float = 0
        self.num_test_batches: int | float = 0
        self.num_predict_batches: int | float = 0
        self.schedule = ValidationSchedule()

    def fit_loaders(self, train_loader: Any, val_loader: Any, warn: Callable[[str], None]) -> tuple[Any, Any]:
        """fit's loaders as the limits want them: read in order with overfit_batches; no val loader with
        limit_val_batches=0 (fit then never validates, as in Lightning)."""
        if self.limits.overfit:
            train_loader = sequential_loader("train_loader", train_loader, warn)
            val_loader = sequential_loader("val_loader", val_loader, warn) if val_loader is not None else None
        return train_loader, None if self.limits.val == 0 else val_loader

    def plan_fit(self, train_loader: Any, val_loader: Any, fresh: bool, lengths: LoopLengths,
                 accumulation: int) -> None:
        """Plans a fit on its prepared loaders; `fresh` is False for a resumed fit, which skips the sanity check.

        Raises:
            ValueError: for a limit or a validation interval these loaders cannot honour.
        """
        self.train = batches_to_run("limit_train_batches", self.limits.train, train_loader)
        self.num_training_batches = counted(self.train, train_loader)
        self.val = self.eval_limit("val", val_loader) if val_loader is not None else None
        sanity = self.limits.sanity if fresh else 0
        if val_loader is None or sanity == 0:
            self.sanity, self.num_sanity_val_batches = 0, 0
        else:
            own = batches_to_run("num_sanity_val_steps", sanity, val_loader)
            self.sanity = min((n for n in (own, self.val) if n is not None), default=None)
            self.num_sanity_val_batches = counted(self.sanity, val_loader)
        epoch = None if math.isinf(self.num_training_batches) else int(self.num_training_batches)
        self.schedule = validation_schedule(lengths.val_every_n_epochs, lengths.val_every_n_steps,
                                            val_loader is not None, steps_per_epoch(epoch, accumulation))

    def eval_limit(self, stage: str, loader: Any) -> int | None:
        """The batches the `stage` loop ("val", "test", "predict") runs on the prepared `loader` (None: all),
        also counted as `num_{stage}_batches`."""
        limit = batches_to_run(f"limit_{stage}_batches", getattr(self.limits, stage), loader)
        setattr(self, f"num_{stage}_batches", counted(limit, loader))
        return limit
