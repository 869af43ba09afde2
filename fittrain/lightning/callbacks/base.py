"""Lightning's `Callback`, whose hooks take `(trainer, pl_module, ...)`, run by fittrain's event loop.

The native loop calls native callbacks' hooks with the trainer alone. A Lightning callback is run
through a `HookAdapter`: a native callback whose class defines exactly the events the Lightning
callback's class overrides (decided once, when the Trainer is built, so an unused hook costs
nothing per step), each calling the Lightning hooks of that event with Lightning's arguments.
The arguments are the module hooks' (fittrain/trainer/module_hooks.py: the same names and the same
arguments after `pl_module`), so both read them from one table. `setup` and `teardown` are called
by the Trainer around each stage (fittrain/lightning/stages.py), and `on_save_checkpoint`/
`on_load_checkpoint` with the callback's own `state_dict` inside fittrain's checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from fittrain.trainer.events import Callback as NativeCallback
from fittrain.trainer.events import Event
from fittrain.trainer.module_hooks import MODULE_HOOKS

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer

#: Lightning callback hooks with no fittrain event -> what to use instead.
UNSUPPORTED_HOOKS = {
    "on_before_zero_grad": "on_before_optimizer_step (gradients are zeroed right after the optimizer step)",
}
#: Lightning hooks run by the sanity check (Trainer(num_sanity_val_steps=...)), by event name.
SANITY_HOOKS = {"on_sanity_check_start": "SANITY_CHECK_START", "on_sanity_check_end": "SANITY_CHECK_END"}


class Callback:
    """Lightning's callback base class: override the hooks you need; each takes the Trainer and the
    module (`pl_module`) first, then Lightning's arguments.

    Example:
        >>> class PrintEpoch(Callback):
        ...     def on_train_epoch_end(self, trainer, pl_module):
        ...         print(trainer.current_epoch, trainer.callback_metrics.get("loss"))
    """

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints."""
        return type(self).__qualname__

    def setup(self, trainer: "Trainer", pl_module: Any, stage: str) -> None:
        """When fit, validate, test or predict begins, after the datamodule's setup."""

    def teardown(self, trainer: "Trainer", pl_module: Any, stage: str) -> None:
        """When fit, validate, test or predict ends."""

    def on_fit_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_fit_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_sanity_check_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_sanity_check_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_train_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_train_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_train_epoch_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_train_epoch_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_train_batch_start(self, trainer: "Trainer", pl_module: Any, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, trainer: "Trainer", pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None: ...
    def on_before_backward(self, trainer: "Trainer", pl_module: Any, loss: Any) -> None: ...
    def on_after_backward(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_before_optimizer_step(self, trainer: "Trainer", pl_module: Any, optimizer: Any) -> None: ...
    def on_validation_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_validation_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_validation_epoch_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_validation_epoch_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_validation_batch_start(self, trainer: "Trainer", pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, trainer: "Trainer", pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None: ...
    def on_test_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_test_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_test_epoch_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_test_epoch_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_test_batch_start(self, trainer: "Trainer", pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, trainer: "Trainer", pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_predict_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_predict_epoch_start(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_predict_epoch_end(self, trainer: "Trainer", pl_module: Any) -> None: ...
    def on_predict_batch_start(self, trainer: "Trainer", pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, trainer: "Trainer", pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None: ...
    def on_exception(self, trainer: "Trainer", pl_module: Any, exception: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """State to keep in checkpoints (tensors, numbers, strings, lists, dicts)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""

    def on_save_checkpoint(self, trainer: "Trainer", pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is saved: entries put into `checkpoint` come back to `on_load_checkpoint`."""

    def on_load_checkpoint(self, trainer: "Trainer", pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """When a checkpoint is loaded (a resumed fit)."""

    def native_callbacks(self, trainer: "Trainer") -> list[NativeCallback]:
        """The native callbacks that run this one in `trainer`'s loop: a `HookAdapter` when its class
        overrides a hook or has state; none otherwise. Mapped callbacks (ModelCheckpoint, ...) add theirs."""
        check_callback(self)
        return [hook_adapter(self, trainer)] if overridden(self) else []


def overridden(callback: Callback) -> list[str]:
    """The hooks (and state methods) a program's class defines for `callback`: those of the classes of
    fittrain.lightning itself (ModelCheckpoint's state, ...) are run by their native callbacks instead."""
    found = []
    for name in _HOOK_NAMES:
        owner = next((klass for klass in type(callback).__mro__ if name in klass.__dict__), Callback)
        if not owner.__module__.startswith("fittrain.lightning."):
            found.append(name)
    return found


_STATE_NAMES = ("state_dict", "load_state_dict", "on_save_checkpoint", "on_load_checkpoint")
_HOOK_NAMES = tuple(hook.name for hook in MODULE_HOOKS) + tuple(SANITY_HOOKS) + _STATE_NAMES


def check_callback(callback: Callback) -> None:
    """Refuses a Lightning hook fittrain has no event for (`UNSUPPORTED_HOOKS`).

    Raises:
        NotImplementedError: naming the hook and what to use instead.
    """
    for name, instead in UNSUPPORTED_HOOKS.items():
        if getattr(type(callback), name, None) is not None:
            raise NotImplementedError(f"{type(callback).__name__}.{name} is a Lightning hook that fittrain.lightning "
                                      f"has no event for, so it would never run. Use {instead}.")


class HookAdapter(NativeCallback):
    """A native callback running a Lightning callback's hooks; `hook_adapter` builds its class.

    Args:
        callback: The Lightning callback.
        trainer: The Lightning Trainer (what the hooks receive as `trainer`).
    """

    def __init__(self, callback: Callback, trainer: "Trainer") -> None:
        self.callback, self.trainer = callback, trainer

    def state_dict(self) -> dict[str, Any]:
        """The callback's `state_dict()` and what its `on_save_checkpoint` added."""
        checkpoint: dict[str, Any] = {}
        self.callback.on_save_checkpoint(self.trainer, self.trainer.lightning_module, checkpoint)
        return {"state": self.callback.state_dict(), "checkpoint": checkpoint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Gives the callback back what `state_dict` saved."""
        self.callback.load_state_dict(dict(state.get("state", {})))
        self.callback.on_load_checkpoint(self.trainer, self.trainer.lightning_module, dict(state.get("checkpoint", {})))

    def __repr__(self) -> str:
        return f"HookAdapter({type(self.callback).__name__})"


def hook_adapter(callback: Callback, trainer: "Trainer") -> HookAdapter:
    """A `HookAdapter` whose class defines the native events `callback` overrides hooks of."""
    check_callback(callback)
    names = set(overridden(callback))
    by_event: dict[str, list[tuple[str, Callable[[Any], tuple]]]] = {}
    for hook in MODULE_HOOKS:
        if hook.name in names:
            by_event.setdefault(hook.event.value, []).append((hook.name, hook.args))
    for name, event in SANITY_HOOKS.items():
        if name in names:
            by_event.setdefault(Event[event].value, []).append((name, _no_args))
    methods = {event: _event_method(event, hooks) for event, hooks in by_event.items()}
    cls = type(f"HookAdapter[{type(callback).__name__}]", (HookAdapter,), methods)
    return cls(callback, trainer)


def _no_args(trainer: Any) -> tuple:
    return ()


def _event_method(event: str, hooks: list[tuple[str, Callable[[Any], tuple]]]) -> Callable[..., None]:
    if event == Event.EXCEPTION.value:
        def on_exception(self: HookAdapter, trainer: Any, exception: BaseException) -> None:
            self.callback.on_exception(self.trainer, self.trainer.lightning_module, exception)
        return on_exception
    bound = tuple(hooks)

    def run(self: HookAdapter, trainer: Any) -> None:
        module = self.trainer.lightning_module
        for name, args in bound:
            getattr(self.callback, name)(self.trainer, module, *_lightning_args(name, args(trainer)))

    run.__name__ = event
    return run


def _lightning_args(name: str, args: tuple) -> tuple:
    """Lightning's training batch `outputs` is a dict: a loss returned alone is `{"loss": loss}`."""
    if name == "on_train_batch_end" and args and hasattr(args[0], "detach"):
        return ({"loss": args[0].detach()}, *args[1:])
    return args
