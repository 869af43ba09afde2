"""`lightning.pytorch.core`'s names, at Lightning's module paths (`from fittrain.lightning.core import
LightningModule`, `from fittrain.lightning.core.module import LightningModule`, ...).

    LightningModule      core/module.py      (defined in fittrain/lightning/module.py)
    LightningDataModule  core/datamodule.py  (defined in fittrain/lightning/module.py)
"""

from fittrain.lightning.module import LightningDataModule, LightningModule

__all__ = ["LightningDataModule", "LightningModule"]
