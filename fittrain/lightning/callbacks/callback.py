"""`lightning.pytorch.callbacks.callback`'s path for `Callback` (base.py)."""

from fittrain.lightning.callbacks.base import Callback

__all__ = ["Callback"]
