"""`lightning.pytorch.core`'s names (`from fittrain.lightning.core import LightningModule`)."""

from fittrain.lightning.module import LightningDataModule, LightningModule

__all__ = ["LightningDataModule", "LightningModule"]
