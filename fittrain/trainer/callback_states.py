"""All callbacks' states as one object that checkpoints save and restore (custom_checkpoint_1.pt)."""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch

from fittrain.trainer.events import Callback


class CallbackStates:
    """All callbacks' states as one checkpointed object, keyed by position and class name."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = callbacks

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for i, cb in enumerate(self.callbacks):
            states[f"{i}:{type(cb).__name__}"] = state = cb.state_dict()
            check_loadable(cb, state)
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, cb in enumerate(self.callbacks):
            saved = state.get(f"{i}:{type(cb).__name__}")
            if saved:
                cb.load_state_dict(saved)


def check_loadable(callback: Callback, state: Any) -> None:
    """Fails at save time, naming the callback, for state a checkpoint could not load back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:
        raise TypeError(
            f"{type(callback).__name__}.state_dict() returned state that a checkpoint cannot load back safely "
            f"(torch.load(weights_only=True) refuses it: {str(err).splitlines()[0]}). Return tensors, Python "
            "numbers, strings, lists, tuples, dicts or None, e.g. float(x) or torch.from_numpy(a).") from None
