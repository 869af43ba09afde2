"""`lightning.pytorch.loggers.tensorboard`'s path for `TensorBoardLogger` (files.py)."""

from fittrain.lightning.loggers.files import TensorBoardLogger

__all__ = ["TensorBoardLogger"]
