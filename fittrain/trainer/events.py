"""Lifecycle events, the `Callback` base class, and the dispatcher that fires them.

The loop that fires them, in the order `Trainer.fit` runs it::

    on_fit_start                      before prepare(): a callback may still configure trainer.accelerator
    [a fresh fit that validates, with num_sanity_val_steps: on_sanity_check_start, then on_validation_start
     ... on_validation_end over that many batches (trainer.sanity_checking is True), on_sanity_check_end]
    on_train_start                    after prepare(), a resumed checkpoint's loading and the sanity check
                                      (from here to on_train_end: only when there is training left to do,
                                      not for a resumed run that had ended or limit_train_batches=0)
    for each epoch:
        on_train_epoch_start
        for each batch:
            on_train_batch_start
            loss = module.training_step(batch)          # under autocast; None skips to batch end
            on_before_backward
            accelerator.backward(loss)
            on_after_backward
            if this is a sync step (the end of an accumulation window):
                on_before_optimizer_step              # GradClip acts here
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
                if val_every_n_steps is set and this step is due (fittrain/trainer/validation_schedule.py):
                    on_validation_start ... on_validation_end   # as below, in the middle of the epoch
            on_train_batch_end                        # Checkpointer(every_n_steps) saves here
            end the epoch here if that validation set trainer.state.should_stop, or max_time has passed
        if validating at the end of this epoch (every val_every_n_epochs, unless val_every_n_steps is set):
            on_validation_start
            on_validation_batch_start, on_validation_batch_end  (around each validation batch)
            on_validation_end                         # EarlyStop decides here
        on_train_epoch_end                            # Checkpointer(every_n_epochs) saves here (with a monitor
                                                      # and mid-epoch validation: at on_train_batch_end)
        stop if trainer.state.should_stop
    on_train_end
    on_fit_end
    on_exception(trainer, exception)   instead of the rest, when anything raises; then it re-raises

`Trainer.validate`, `Trainer.test` and `Trainer.predict` run outside fit (or after it) and fire
only their own events (not on_exception), after the module and the loader are prepared::

    on_validation_start, on_validation_batch_start/_end (each batch), on_validation_end    validate
    on_test_start                     then test_step (or validation_step) on each batch
        on_test_batch_start, on_test_batch_end  (around each test batch)
    on_test_end                       trainer.state.metrics holds the averaged test_* metrics
    on_predict_start                  then predict_step on each batch; each round gathered
        on_predict_batch_start, on_predict_batch_end  (around each batch)
    on_predict_end                    before predict() returns the outputs

A validation after an optimizer step runs before that batch's on_train_batch_end, so a checkpoint
saved there holds its outcome (metrics, EarlyStop's state); resuming from it continues with the
next batch and does not validate again. An epoch never validates twice at one step: with
val_every_n_steps there is no validation at epoch ends (fittrain/trainer/validation_schedule.py).

The sanity check (`Trainer(num_sanity_val_steps=n)`) is Lightning's: a few validation batches
before training, so that a broken `validation_step` fails at once rather than after an epoch. Its
metrics are discarded and the random state is put back afterwards, so training draws the same
numbers with or without it; a resumed fit does not run it. Callbacks that act on validations
read `trainer.sanity_checking` to skip it, as Lightning's do.

The module takes part too (fittrain/trainer/module_hooks.py): at each event its own hooks, under
Lightning's names and arguments, run first, then the callbacks' hooks in list order.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from fittrain.common.reprs import short_repr

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


class Event(str, enum.Enum):
    """Every hook a callback may implement, named as the method it calls."""

    FIT_START = "on_fit_start"
    SANITY_CHECK_START = "on_sanity_check_start"
    SANITY_CHECK_END = "on_sanity_check_end"
    TRAIN_START = "on_train_start"
    TRAIN_EPOCH_START = "on_train_epoch_start"
    TRAIN_BATCH_START = "on_train_batch_start"
    BEFORE_BACKWARD = "on_before_backward"
    AFTER_BACKWARD = "on_after_backward"
    BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    TRAIN_BATCH_END = "on_train_batch_end"
    VALIDATION_START = "on_validation_start"
    VALIDATION_BATCH_START = "on_validation_batch_start"
    VALIDATION_BATCH_END = "on_validation_batch_end"
    VALIDATION_END = "on_validation_end"
    TRAIN_EPOCH_END = "on_train_epoch_end"
    TRAIN_END = "on_train_end"
    FIT_END = "on_fit_end"
    EXCEPTION = "on_exception"
    TEST_START = "on_test_start"
    TEST_BATCH_START = "on_test_batch_start"
    TEST_BATCH_END = "on_test_batch_end"
    TEST_END = "on_test_end"
    PREDICT_START = "on_predict_start"
    PREDICT_BATCH_START = "on_predict_batch_start"
    PREDICT_BATCH_END = "on_predict_batch_end"
    PREDICT_END = "on_predict_end"


EVENT_NAMES = tuple(e.value for e in Event)


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """What a callback asks of the fit's run; the Trainer reads it through `Callback.run_request`.

    The Trainer layer knows no callback class: a Logger and a Checkpointer say what they need here.

    Attributes:
        name: A run name the callback was given (a Logger's `run_name`), or None.
        log_dir: A folder where the callback writes the run's logs: a new run's name must be free there.
        writes_logs: The callback writes the run's logs (into `log_dir`, else the project's `logs/`).
        saves_checkpoints: The callback saves checkpoints into the run's folder; a Trainer takes one such
            callback, as two would number the same folders.
        shows_progress: The callback draws the fit's progress (or was told not to): the Trainer adds
            no default `ProgressBar`.
    """

    name: str | None = None
    log_dir: str | None = None
    writes_logs: bool = False
    saves_checkpoints: bool = False
    shows_progress: bool = False


_NO_REQUEST = RunRequest()


class Callback:
    """Base class for objects that act at points of `Trainer.fit` (and of `validate`, `test` and
    `predict`); every hook is a no-op.

    Override only the hooks you need: the Trainer calls a hook only on callbacks that override
    it, so unused events cost nothing. A callback with state implements `state_dict` and
    `load_state_dict`; that state travels inside every checkpoint. See this module's docstring
    for the order in which hooks run.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_train_epoch_end(self, trainer):
        ...         print(trainer.state.epoch, trainer.state.metrics.get("train_loss"))
    """

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Before prepare(): configure `trainer.accelerator` here."""

    def on_sanity_check_start(self, trainer: "Trainer") -> None:
        """Before the sanity check's validation (`num_sanity_val_steps`), after prepare()."""

    def on_sanity_check_end(self, trainer: "Trainer") -> None:
        """After the sanity check's validation, before its metrics are discarded."""

    def on_train_start(self, trainer: "Trainer") -> None:
        """After prepare(), a resumed checkpoint's loading and the sanity check, before the first epoch."""

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """At the start of each training epoch."""

    def on_train_batch_start(self, trainer: "Trainer") -> None:
        """Before `training_step` of each batch."""

    def on_before_backward(self, trainer: "Trainer") -> None:
        """After `training_step`, before `accelerator.backward(loss)`."""

    def on_after_backward(self, trainer: "Trainer") -> None:
        """After backward; gradients of this batch have been accumulated."""

    def on_before_optimizer_step(self, trainer: "Trainer") -> None:
        """On sync steps only, before `optimizer.step()`: gradients are final (and unscalable)."""

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """After the batch, and after the optimizer step on sync steps."""

    def on_validation_start(self, trainer: "Trainer") -> None:
        """Before the validation loop."""

    def on_validation_batch_start(self, trainer: "Trainer") -> None:
        """Before each validation batch."""

    def on_validation_batch_end(self, trainer: "Trainer") -> None:
        """After each validation batch."""

    def on_validation_end(self, trainer: "Trainer") -> None:
        """After validation; `trainer.state.metrics` holds the averaged validation metrics."""

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """At the end of each epoch, after its validation."""

    def on_train_end(self, trainer: "Trainer") -> None:
        """After the last epoch (or step) trained, before `on_fit_end`."""

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Once training finished normally."""

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """When anything in fit raised; the exception propagates afterwards."""

    def on_test_start(self, trainer: "Trainer") -> None:
        """In `Trainer.test`, before the first batch (the module and loader are prepared)."""

    def on_test_batch_start(self, trainer: "Trainer") -> None:
        """In `Trainer.test`, before each batch."""

    def on_test_batch_end(self, trainer: "Trainer") -> None:
        """In `Trainer.test`, after each batch."""

    def on_test_end(self, trainer: "Trainer") -> None:
        """In `Trainer.test`, after the loop; `trainer.state.metrics` holds the averaged test_* metrics."""

    def on_predict_start(self, trainer: "Trainer") -> None:
        """In `Trainer.predict`, before the first batch (the module and loader are prepared)."""

    def on_predict_batch_start(self, trainer: "Trainer") -> None:
        """In `Trainer.predict`, before each batch."""

    def on_predict_batch_end(self, trainer: "Trainer") -> None:
        """In `Trainer.predict`, after each batch's outputs were gathered."""

    def on_predict_end(self, trainer: "Trainer") -> None:
        """In `Trainer.predict`, after the loop, before the outputs are returned."""

    def run_request(self) -> RunRequest:
        """What this callback asks of the fit's run (a name, a logs folder, checkpoint saving); by default nothing."""
        return _NO_REQUEST

    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (JSON-like: numbers, strings, lists, dicts, tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""


def _overrides(callback: Callback, name: str) -> bool:
    return getattr(type(callback), name, None) is not getattr(Callback, name)


def check_callbacks(callbacks: Any) -> list[Callback]:
    """Returns `callbacks` (None or an iterable of Callback instances) as a new list.

    Raises:
        TypeError: for a single callback instead of a list, or anything that is not a list of them.
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        name = type(callbacks).__name__
        raise TypeError(f"`callbacks` must be a list of callbacks. Received a single callback: callbacks={name}(...). "
                        f"Pass a list, e.g. callbacks=[{name}(...)].")
    if isinstance(callbacks, (str, bytes, dict)) or not isinstance(callbacks, Iterable):
        raise TypeError(f"`callbacks` must be a list of Callback instances, or None. Received: callbacks="
                        f"{short_repr(callbacks)} ({type(callbacks).__name__}). Pass e.g. callbacks=[GradClip(1.0)].")
    return list(callbacks)


def _check_callback(callback: Any) -> None:
    if not isinstance(callback, Callback):
        raise TypeError(
            "`callbacks` must hold Callback instances. "
            f"Received: {short_repr(callback)} (type {type(callback).__name__}). Subclass fittrain.Callback."
        )
    for name in sorted(n for n in dir(type(callback)) if n.startswith("on_") and n not in EVENT_NAMES):
        near = nearest_hook(name, EVENT_NAMES)
        raise ValueError(
            f"{type(callback).__name__} defines {name}, which is not an event, so it would never run. "
            + (f"Did you mean {near}? " if near else "") + f"Valid hook names: {', '.join(EVENT_NAMES)}."
        )


#: Hook names of Lightning 1.x (and a few Lightning hooks fittrain has no event for) -> the hook to use.
_RENAMED = {"on_epoch_start": "on_train_epoch_start", "on_epoch_end": "on_train_epoch_end",
            "on_batch_start": "on_train_batch_start", "on_batch_end": "on_train_batch_end",
            "on_pretrain_routine_start": "on_fit_start", "on_pretrain_routine_end": "on_train_start",
            "on_before_zero_grad": "on_before_optimizer_step"}


def nearest_hook(name: str, hooks: Iterable[str]) -> str | None:
    """The hook that `name` most likely meant: its Lightning 1.x successor, else the closest spelling."""
    hooks = list(hooks)
    if _RENAMED.get(name) in hooks:
        return _RENAMED[name]
    near = difflib.get_close_matches(name, hooks, n=1, cutoff=0.5)
    return near[0] if near else None


#: (label for error notes, hook) pairs per event; a hook is called as hook(trainer).
Hooks = dict[Event, tuple[tuple[str, Callable[..., None]], ...]]


class EventDispatcher:
    """Calls each event's hooks: the module's (fittrain/trainer/module_hooks.py), then those of the
    callbacks that override it, in list order.

    Hooks are looked up once, here, so firing an event nobody listens to is a loop over an
    empty tuple. A hook's exception keeps its type and gains a note naming hook and event.

    Args:
        callbacks: Callback instances.
        muted: Callbacks among them whose hooks never run (`fast_dev_run` mutes those that save
            checkpoints or write logs); they stay in `callbacks`, and their state in checkpoints.

    Raises:
        TypeError: for an item that is not a Callback.
        ValueError: for a method named like a hook that is not an event.
    """

    def __init__(self, callbacks: Sequence[Callback], muted: Sequence[Callback] = ()) -> None:
        for callback in callbacks:
            _check_callback(callback)
        self.callbacks = list(callbacks)
        self.active = [cb for cb in self.callbacks if not any(cb is m for m in muted)]
        self._callback_hooks: Hooks = {
            event: tuple((f"callback {type(cb).__name__}.{event.value}", getattr(cb, event.value))
                         for cb in self.active if _overrides(cb, event.value))
            for event in Event
        }
        # Decided once per module: an event nobody overrides is a loop over an empty tuple per step.
        self._hooks: Hooks = self._callback_hooks

    def use_module_hooks(self, module_hooks: Hooks) -> None:
        """Runs `module_hooks` (the module's own, bound by module_hooks.bind_module_hooks) before the
        callbacks' at each event, replacing those of a previous module."""
        self._hooks = {event: module_hooks.get(event, ()) + hooks for event, hooks in self._callback_hooks.items()}

    def listens(self, event: Event) -> bool:
        """Whether any hook runs at `event` (a per-step path asks once, then skips `fire` when none does)."""
        return bool(self._hooks[event])

    def hooks(self, event: Event) -> tuple[tuple[str, Callable[..., None]], ...]:
        """`event`'s (label, hook) pairs, for the per-batch path, which calls them as `fire` does."""
        return self._hooks[event]

    def fire(self, event: Event, trainer: "Trainer") -> None:
        """Runs `event`'s hooks with `trainer`."""
        for label, hook in self._hooks[event]:
            try:
                hook(trainer)
            except Exception as exc:
                exc.add_note(f"Raised in {label}.")
                raise

    def run_requests(self) -> list[tuple[Callback, RunRequest]]:
        """Each callback that is not muted with what it asks of the fit's run (`Callback.run_request`), in
        list order."""
        return [(cb, cb.run_request()) for cb in self.active]

    def fire_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Runs `on_exception` hooks; their own errors are noted on the original, never raised."""
        for label, hook in self._hooks[Event.EXCEPTION]:
            try:
                hook(trainer, exception)
            except Exception as inner:  # the original exception is the one users must see
                exception.add_note(f"{label} also raised: {inner!r}")


def muted_in_dev_run(callbacks: Sequence[Any]) -> list[Callback]:
    """The callbacks a `fast_dev_run` mutes, as Lightning does: those that save checkpoints or write logs
    (`RunRequest.saves_checkpoints`, `RunRequest.writes_logs`)."""
    return [cb for cb in callbacks if isinstance(cb, Callback)
            and (cb.run_request().saves_checkpoints or cb.run_request().writes_logs)]
