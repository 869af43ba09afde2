"""The module's own hooks: a `TrainModule` takes part in the loop under Lightning's hook names.

Every event of fittrain/trainer/events.py reaches the module too, as a method named like the
event with Lightning's arguments instead of the trainer (the module has `self.trainer`), plus
Lightning's epoch-level names for the evaluation loops::

    on_fit_start()          on_train_start()          on_train_epoch_start()
    on_train_batch_start(batch, batch_idx)            on_train_batch_end(outputs, batch, batch_idx)
    on_before_backward(loss)  on_after_backward()     on_before_optimizer_step(optimizer)
    on_validation_start()   on_validation_epoch_start()
    on_validation_batch_start(batch, batch_idx)       on_validation_batch_end(outputs, batch, batch_idx)
    on_validation_epoch_end()  on_validation_end()    (test_ and predict_ alike)
    on_train_epoch_end()    on_train_end()            on_fit_end()          on_exception(exception)
    on_save_checkpoint(checkpoint)  on_load_checkpoint(checkpoint)     (fittrain/trainer/callback_states.py)

At each event the module's hooks run first, then the callbacks' in list order: what the module
logs or decides there (a metric computed in `on_validation_epoch_end`, `trainer.state.should_stop`)
is what EarlyStop, the Checkpointer and the Logger see at that same event. (Lightning runs its
callbacks first, except the monitoring ones at epoch ends, for the same reason.) Where two names
share an event, Lightning's order holds: `on_validation_start` before `on_validation_epoch_start`,
`on_validation_epoch_end` before `on_validation_end`.

Only hooks the module's class overrides are bound, once per fit (or validate, test, predict), so
an unused hook costs nothing per step. A method named `on_*` that is no hook, or a hook whose
signature cannot take its arguments, is an error before anything runs: it would never be called,
or fail in the middle of training.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable

from fittrain.trainer.events import Event, nearest_hook

if TYPE_CHECKING:
    from fittrain.trainer.module import TrainModule
    from fittrain.trainer.trainer import Trainer


def _none(trainer: "Trainer") -> tuple:
    return ()


def _train_batch(trainer: "Trainer") -> tuple:
    return trainer.batch, trainer.state.batch_idx


def _train_batch_end(trainer: "Trainer") -> tuple:
    return trainer.optimization.outputs, trainer.batch, trainer.state.batch_idx


def _loss(trainer: "Trainer") -> tuple:
    return (trainer.optimization.loss,)


def _optimizer(trainer: "Trainer") -> tuple:
    return (trainer.optimizer,)  # the one stepping now, in manual optimization too


def _eval_batch(trainer: "Trainer") -> tuple:
    return trainer.evaluation.batch, trainer.evaluation.batch_idx


def _eval_batch_end(trainer: "Trainer") -> tuple:
    evaluation = trainer.evaluation
    return evaluation.outputs, evaluation.batch, evaluation.batch_idx


@dataclasses.dataclass(frozen=True)
class ModuleHook:
    """One hook of the module: its name, the event it runs at, and its Lightning arguments.

    Attributes:
        name: The method's name.
        event: The event at which it runs.
        args: Reads the hook's positional arguments from the Trainer when the event fires.
        params: The arguments' names, for error messages.
    """

    name: str
    event: Event
    args: Callable[["Trainer"], tuple] = _none
    params: tuple[str, ...] = ()


def _stage_hooks(stage: str, start: Event, batch_start: Event, batch_end: Event, end: Event) -> list[ModuleHook]:
    return [ModuleHook(f"on_{stage}_start", start), ModuleHook(f"on_{stage}_epoch_start", start),
            ModuleHook(f"on_{stage}_batch_start", batch_start, _eval_batch, ("batch", "batch_idx")),
            ModuleHook(f"on_{stage}_batch_end", batch_end, _eval_batch_end, ("outputs", "batch", "batch_idx")),
            ModuleHook(f"on_{stage}_epoch_end", end), ModuleHook(f"on_{stage}_end", end)]


#: Every hook, in the order hooks that share an event run.
MODULE_HOOKS: tuple[ModuleHook, ...] = (
    ModuleHook("on_fit_start", Event.FIT_START),
    ModuleHook("on_train_start", Event.TRAIN_START),
    ModuleHook("on_train_epoch_start", Event.TRAIN_EPOCH_START),
    ModuleHook("on_train_batch_start", Event.TRAIN_BATCH_START, _train_batch, ("batch", "batch_idx")),
    ModuleHook("on_before_backward", Event.BEFORE_BACKWARD, _loss, ("loss",)),
    ModuleHook("on_after_backward", Event.AFTER_BACKWARD),
    ModuleHook("on_before_optimizer_step", Event.BEFORE_OPTIMIZER_STEP, _optimizer, ("optimizer",)),
    ModuleHook("on_train_batch_end", Event.TRAIN_BATCH_END, _train_batch_end, ("outputs", "batch", "batch_idx")),
    *_stage_hooks("validation", Event.VALIDATION_START, Event.VALIDATION_BATCH_START, Event.VALIDATION_BATCH_END,
                  Event.VALIDATION_END),
    ModuleHook("on_train_epoch_end", Event.TRAIN_EPOCH_END),
    ModuleHook("on_train_end", Event.TRAIN_END),
    ModuleHook("on_fit_end", Event.FIT_END),
    ModuleHook("on_exception", Event.EXCEPTION, params=("exception",)),  # called with it: see bind_module_hooks
    *_stage_hooks("test", Event.TEST_START, Event.TEST_BATCH_START, Event.TEST_BATCH_END, Event.TEST_END),
    *_stage_hooks("predict", Event.PREDICT_START, Event.PREDICT_BATCH_START, Event.PREDICT_BATCH_END,
                  Event.PREDICT_END),
)
#: Hooks around checkpoints rather than events (fittrain/trainer/callback_states.py calls them).
STATE_HOOKS = {"on_save_checkpoint": ("checkpoint",), "on_load_checkpoint": ("checkpoint",)}
HOOK_NAMES = frozenset([hook.name for hook in MODULE_HOOKS] + list(STATE_HOOKS))


class LifecycleHooks:
    """The module's hooks, all no-ops; `TrainModule` inherits them. Override those you need (see
    this module's docstring for when each runs); `self.trainer` is the running Trainer."""

    def on_fit_start(self) -> None:
        """At the start of fit, before prepare() (the optimizers do not exist yet)."""

    def on_train_start(self) -> None:
        """After prepare() and after a resumed checkpoint was loaded, before the first epoch."""

    def on_train_epoch_start(self) -> None:
        """At the start of each training epoch."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before `training_step` on `batch`, the `batch_idx`-th of its epoch."""

    def on_before_backward(self, loss: Any) -> None:
        """Before backward on `loss` (automatic optimization: the loss training_step returned)."""

    def on_after_backward(self) -> None:
        """After backward: this batch's gradients are accumulated."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Before `optimizer` steps, gradients final and unclipped (GradClip, a callback, runs after)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After the batch (and its optimizer step); `outputs` is what training_step returned."""

    def on_train_epoch_end(self) -> None:
        """At the end of each epoch, after its validation; before the callbacks' (Checkpointer) hooks."""

    def on_train_end(self) -> None:
        """After the last epoch or step trained."""

    def on_fit_end(self) -> None:
        """Once fit finished normally."""

    def on_exception(self, exception: BaseException) -> None:
        """When anything in fit raised; the exception propagates afterwards."""

    def on_validation_start(self) -> None:
        """Before the validation loop."""

    def on_validation_epoch_start(self) -> None:
        """Before the validation loop, after `on_validation_start`."""

    def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before `validation_step` on each batch."""

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After `validation_step` returned `outputs` for `batch`."""

    def on_validation_epoch_end(self) -> None:
        """After the validation loop: `trainer.state.metrics` holds the averaged metrics; what is
        logged here is seen by EarlyStop and the Checkpointer at this validation."""

    def on_validation_end(self) -> None:
        """After the validation loop, after `on_validation_epoch_end`."""

    def on_test_start(self) -> None:
        """In `Trainer.test`, before the first batch."""

    def on_test_epoch_start(self) -> None:
        """In `Trainer.test`, after `on_test_start`."""

    def on_test_batch_start(self, batch: Any, batch_idx: int) -> None:
        """In `Trainer.test`, before each batch."""

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """In `Trainer.test`, after each batch's step returned `outputs`."""

    def on_test_epoch_end(self) -> None:
        """In `Trainer.test`, after the loop: `trainer.state.metrics` holds the test_* metrics."""

    def on_test_end(self) -> None:
        """In `Trainer.test`, after `on_test_epoch_end`."""

    def on_predict_start(self) -> None:
        """In `Trainer.predict`, before the first batch."""

    def on_predict_epoch_start(self) -> None:
        """In `Trainer.predict`, after `on_predict_start`."""

    def on_predict_batch_start(self, batch: Any, batch_idx: int) -> None:
        """In `Trainer.predict`, before each batch."""

    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """In `Trainer.predict`, after `predict_step` returned `outputs` for `batch`."""

    def on_predict_epoch_end(self) -> None:
        """In `Trainer.predict`, after the loop."""

    def on_predict_end(self) -> None:
        """In `Trainer.predict`, after `on_predict_epoch_end`, before the outputs are returned."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is saved: put entries of your own into `checkpoint` (tensors, numbers,
        strings, lists, dicts; never unpickled), and they come back to `on_load_checkpoint`."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is loaded (a resumed fit): `checkpoint` holds what `on_save_checkpoint`
        put there (empty when the checkpoint holds nothing of this module's)."""


def overrides(module: "TrainModule", name: str) -> bool:
    """Whether the module's class overrides the no-op hook `name` of `LifecycleHooks`."""
    return getattr(type(module), name, None) is not getattr(LifecycleHooks, name)


def check_module_hooks(module: "TrainModule") -> None:
    """Refuses an `on_*` method that is no hook, and a hook that cannot take its arguments.

    Raises:
        ValueError: naming the method and the nearest hook name.
        TypeError: naming the hook, its signature and the arguments it is called with.
    """
    cls = type(module).__name__
    # Properties are not hooks (LightningModule.on_gpu): only methods named on_* are checked.
    for name in sorted(n for n in dir(type(module)) if n.startswith("on_") and n not in HOOK_NAMES
                       and not isinstance(inspect.getattr_static(type(module), n), property)):
        near = nearest_hook(name, sorted(HOOK_NAMES))
        hint = f"Did you mean {near}? " if near else ""
        raise ValueError(f"{cls} defines {name}, which is not a TrainModule hook, so it would never run. {hint}"
                         f"The hooks are listed in fittrain.trainer.module_hooks (Lightning's names: on_fit_start, "
                         "on_train_epoch_end, on_validation_epoch_end, on_train_batch_end, ...). Rename it, or "
                         "give a helper method a name that does not start with on_.")
    params = {hook.name: hook.params for hook in MODULE_HOOKS} | STATE_HOOKS
    for name, names in params.items():
        if overrides(module, name):
            _check_signature(module, cls, name, names)


def _check_signature(module: "TrainModule", cls: str, name: str, names: tuple[str, ...]) -> None:
    method = getattr(module, name)
    try:
        inspect.signature(method).bind(*names)
    except TypeError:
        raise TypeError(f"{cls}.{name}{inspect.signature(method)} cannot take the arguments it is called with: "
                        f"{name}(self{''.join(', ' + n for n in names)}). Use that signature (Lightning's).") from None
    except ValueError:  # no signature to read (a builtin): it is called and fails, if it must, then
        return


def bind_module_hooks(module: "TrainModule") -> dict[Event, tuple[tuple[str, Callable[..., None]], ...]]:
    """The module's overridden hooks by event, in `MODULE_HOOKS` order, as (label, hook) pairs called
    like a callback's: `hook(trainer)`, or `hook(trainer, exception)` for `Event.EXCEPTION`.

    Raises:
        ValueError, TypeError: see `check_module_hooks`, which runs first.
    """
    check_module_hooks(module)
    bound: dict[Event, list[tuple[str, Callable[..., None]]]] = {event: [] for event in Event}
    for hook in MODULE_HOOKS:
        if overrides(module, hook.name):
            label = f"module {type(module).__name__}.{hook.name}"
            bound[hook.event].append((label, _bound(getattr(module, hook.name), hook)))
    return {event: tuple(hooks) for event, hooks in bound.items()}


def _bound(method: Callable[..., Any], hook: ModuleHook) -> Callable[..., None]:
    if hook.event is Event.EXCEPTION:
        return lambda trainer, exception: method(exception)
    if hook.args is _none:
        return lambda trainer: method()
    args = hook.args
    return lambda trainer: method(*args(trainer))
