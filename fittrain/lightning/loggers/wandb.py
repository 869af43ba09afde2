"""`lightning.pytorch.loggers.wandb`'s path for `WandbLogger` (external.py)."""

from fittrain.lightning.loggers.external import WandbLogger

__all__ = ["WandbLogger"]
