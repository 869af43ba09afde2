"""When fit validates: at epoch ends, or after optimizer steps counted over the fit or within epochs.

`Trainer(val_every_n_epochs=, val_every_n_steps=)` decide it; `validation_schedule` turns them,
once per fit, into an object the loop asks after each optimizer step (`after_step`) and at each
epoch end (`at_epoch_end`), so the loop never branches on the mode:

    val_every_n_epochs  val_every_n_steps   validates
    n (default 1)       None                at the end of every n-th epoch
    None                k (int)             after every k-th optimizer step of the fit (global_step % k == 0)
    None                f (float in (0, 1]) the same, with k = max(1, int(f * steps per epoch))
    n                   k or f              after every k-th step *of the epoch*, counted from its start,
                                            in every n-th epoch

With `val_every_n_steps` there is no validation at epoch ends (one after an epoch's last step is
the last of its steps). Steps per epoch are the epoch's optimizer steps: its batches (after
`limit_train_batches`) divided by `gradient_accumulation_steps`, rounded up. These are
Lightning's `val_check_interval` and `check_val_every_n_epoch`, counted in optimizer steps rather
than batches (the same without gradient accumulation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fittrain.common.checks import ArgumentTypeError, check_positive_int, is_int
from fittrain.common.reprs import short_repr

if TYPE_CHECKING:
    from fittrain.trainer.train_state import TrainState


def check_validation_interval(every_n_epochs: Any, every_n_steps: Any) -> tuple[int | None, int | float | None]:
    """Checks `val_every_n_epochs` (a positive int) and `val_every_n_steps` (a positive int, or a float
    fraction of an epoch in (0, 1]).

    Returns:
        (val_every_n_epochs, val_every_n_steps): the epochs default to 1 when neither is given.

    Raises:
        ValueError: for a value that is neither (ArgumentTypeError, also a TypeError, for a wrong type).
    """
    every_n_epochs = check_positive_int("val_every_n_epochs", every_n_epochs, optional=True, owner="Trainer")
    if every_n_steps is not None and not is_int(every_n_steps):
        wanted = ("a positive int (optimizer steps), a float in (0.0, 1.0] (a fraction of an epoch) or None. "
                  f"Received: val_every_n_steps={short_repr(every_n_steps)}")
        if not isinstance(every_n_steps, float):
            raise ArgumentTypeError(f"`Trainer(val_every_n_steps=...)` must be {wanted}.")
        if not 0.0 < every_n_steps <= 1.0:
            raise ValueError(f"`Trainer(val_every_n_steps=...)` must be {wanted}. Pass an int for a number of steps "
                             "(val_every_n_steps=250), or e.g. 0.25 to validate four times an epoch.")
    elif every_n_steps is not None:
        check_positive_int("val_every_n_steps", every_n_steps, owner="Trainer", wanted=(
            "a positive int (optimizer steps), a float in (0.0, 1.0] (a fraction of an epoch) or None"))
    if every_n_steps is None and every_n_epochs is None:
        every_n_epochs = 1
    return every_n_epochs, every_n_steps


class ValidationSchedule:
    """Whether fit validates now; this base never does (no val_loader, or limit_val_batches=0)."""

    #: Whether `after_step` can answer True: the loop asks it after each optimizer step only then.
    mid_epoch = False
    #: Whether validation, where there is any, ends every epoch and runs nowhere else: then a save at an
    #: epoch's end holds the weights that epoch's validation measured (Checkpointer(monitor=...) asks).
    each_epoch_end = True

    def after_step(self, state: "TrainState") -> bool:
        """Called after each optimizer step: whether a validation follows it."""
        return False

    def at_epoch_end(self, epoch: int) -> bool:
        """Called at the end of epoch `epoch` (from 0): whether a validation ends it."""
        return False


class AtEpochEnds(ValidationSchedule):
    """At the end of every `every`-th epoch."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.each_epoch_end = every == 1

    def at_epoch_end(self, epoch: int) -> bool:
        return (epoch + 1) % self.every == 0


class EveryNSteps(ValidationSchedule):
    """After every `every`-th optimizer step of the fit."""

    mid_epoch = True
    each_epoch_end = False

    def __init__(self, every: int) -> None:
        self.every = every

    def after_step(self, state: "TrainState") -> bool:
        return state.global_step % self.every == 0


class StepsOfEpochs(ValidationSchedule):
    """After every `every`-th optimizer step of every `epochs`-th epoch, counted from the epoch's start."""

    mid_epoch = True
    each_epoch_end = False

    def __init__(self, every: int, epochs: int) -> None:
        self.every, self.epochs = every, epochs

    def after_step(self, state: "TrainState") -> bool:
        return (state.epoch + 1) % self.epochs == 0 and (state.global_step - state.epoch_start_step) % self.every == 0


def validation_schedule(every_n_epochs: int | None, every_n_steps: int | float | None, validates: bool,
                        steps_per_epoch: int | None) -> ValidationSchedule:
    """The schedule of one fit (see the module docstring).

    Args:
        every_n_epochs, every_n_steps: The Trainer's checked arguments.
        validates: Whether this fit validates at all (a val_loader, limit_val_batches > 0).
        steps_per_epoch: Optimizer steps in an epoch, or None when unknown (a stream).

    Raises:
        ValueError: for a fraction of an epoch of unknown length, or steps counted within epochs
            that are longer than an epoch (no validation would ever run).
    """
    if not validates:
        return ValidationSchedule()
    if every_n_steps is None:
        return AtEpochEnds(every_n_epochs)
    every = every_n_steps
    if isinstance(every, float):
        if steps_per_epoch is None:
            raise ValueError(
                f"`Trainer(val_every_n_steps={every!r})` is a fraction of an epoch, and the train loader has no length "
                "(a stream). Pass an int number of optimizer steps, or limit_train_batches=n to make epochs n batches "
                "long, or validate at epoch ends (val_every_n_epochs).")
        every = max(1, int(every * steps_per_epoch))  # Lightning's rounding
    if every_n_epochs is None:
        return EveryNSteps(every)
    if steps_per_epoch is not None and every > steps_per_epoch:
        raise ValueError(
            f"`Trainer(val_every_n_steps={every_n_steps!r}, val_every_n_epochs={every_n_epochs!r})` counts steps "
            f"within each epoch, and an epoch has {steps_per_epoch} optimizer step(s), so it would never validate. "
            f"Pass val_every_n_steps <= {steps_per_epoch}, or val_every_n_epochs=None to count over the whole fit.")
    return StepsOfEpochs(every, every_n_epochs)


def steps_per_epoch(batches: int | None, accumulation: int) -> int | None:
    """Optimizer steps in an epoch of `batches` batches (None: unknown): a partial window at the end steps too."""
    return None if batches is None else -(-batches // accumulation)
