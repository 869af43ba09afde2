"""`lightning.pytorch.core.datamodule`'s path for `LightningDataModule` (fittrain/lightning/module.py)."""

from fittrain.lightning.module import LightningDataModule

__all__ = ["LightningDataModule"]
