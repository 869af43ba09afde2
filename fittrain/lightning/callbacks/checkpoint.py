"""`lightning.pytorch.callbacks.checkpoint`'s path for `Checkpoint`, ModelCheckpoint's base (model_checkpoint.py)."""

from fittrain.lightning.callbacks.model_checkpoint import Checkpoint

__all__ = ["Checkpoint"]
