"""All callbacks' states, what the module's checkpoint hooks keep, a DataModule's state and the module's
torchmetrics states, as one object that checkpoints save and restore (custom_checkpoint_1.pt)."""

from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch

from fittrain.trainer.events import Callback
from fittrain.trainer.metric_objects import STATE_KEY as METRIC_STATES
from fittrain.trainer.module_hooks import overrides

if TYPE_CHECKING:
    from fittrain.trainer.metric_objects import MetricObjects
    from fittrain.trainer.module import TrainModule


class CallbackStates:
    """All callbacks' states as one checkpointed object, keyed by position and class name, and the
    entries the module's `on_save_checkpoint(checkpoint)` adds, under "module:<class name>".

    Args:
        callbacks: The Trainer's callbacks.
        module: The module being fitted; its checkpoint hooks run only if its class overrides them.
    """

    def __init__(self, callbacks: Sequence[Callback], module: "TrainModule | None" = None,
                 datamodule: Any = None, metric_objects: "MetricObjects | None" = None) -> None:
        self.callbacks = callbacks
        self.module = module
        # The states of the torchmetrics Metrics logged in the current epoch (fittrain/trainer/metric_objects.py).
        self.metric_objects = metric_objects
        # A DataModule's state_dict/load_state_dict, when its class defines them (fittrain/trainer/datamodule.py).
        self.datamodule = datamodule if callable(getattr(datamodule, "state_dict", None)) else None

    def _module_key(self) -> str:
        return f"module:{type(self.module).__name__}"  # callbacks' keys start with a digit: never the same

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for i, cb in enumerate(self.callbacks):
            states[f"{i}:{type(cb).__name__}"] = state = cb.state_dict()
            check_loadable(cb, state, "state_dict() returned")
        if self.module is not None and overrides(self.module, "on_save_checkpoint"):
            checkpoint: dict[str, Any] = {}
            self.module.on_save_checkpoint(checkpoint)
            check_loadable(self.module, checkpoint, "on_save_checkpoint(checkpoint) put into checkpoint")
            states[self._module_key()] = checkpoint
        hparams = self.module.recordable_hparams() if self.module is not None else None
        if hparams is not None:
            states[self._hparams_key()] = hparams
        if self.datamodule is not None:
            states[self._datamodule_key()] = state = self.datamodule.state_dict()
            check_loadable(self.datamodule, state)
        metric_states = self.metric_objects.state_dict() if self.metric_objects is not None else None
        if metric_states is not None:
            states[METRIC_STATES] = metric_states
        return states

    def _hparams_key(self) -> str:
        return f"hparams:{type(self.module).__name__}"

    def _datamodule_key(self) -> str:
        return f"datamodule:{type(self.datamodule).__name__}"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            saved = state.get(f"{i}:{type(cb).__name__}")
            if saved:
                cb.load_state_dict(saved)
        if self.module is not None and overrides(self.module, "on_load_checkpoint"):
            self.module.on_load_checkpoint(dict(state.get(self._module_key(), {})))
        saved = state.get(self._hparams_key()) if self.module is not None else None
        if saved is not None and saved != self.module.recordable_hparams():
            warnings.warn(f"Resuming {type(self.module).__name__} with other hyperparameters than the checkpoint's: "
                          f"saved {saved}, now {self.module.recordable_hparams()}. Training goes on with the new "
                          "ones; pass the saved values to resume the same run.", stacklevel=2)
        if self.datamodule is not None and self._datamodule_key() in state:
            self.datamodule.load_state_dict(state[self._datamodule_key()])
        if self.metric_objects is not None:
            self.metric_objects.load_state_dict(state.get(METRIC_STATES))


def check_loadable(owner: Any, state: Any, what: str = "state_dict() returned") -> None:
    """Fails at save time, naming the callback (or module), for state a checkpoint could not load back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:
        raise TypeError(
            f"{type(owner).__name__}.{what} state that a checkpoint cannot load back safely "
            f"(torch.load(weights_only=True) refuses it: {str(err).splitlines()[0]}). Use tensors, Python "
            "numbers, strings, lists, tuples, dicts or None, e.g. float(x) or torch.from_numpy(a).") from None
