"""`lightning.pytorch.core.module`'s path for `LightningModule` (fittrain/lightning/module.py)."""

from fittrain.lightning.module import LightningModule

__all__ = ["LightningModule"]
