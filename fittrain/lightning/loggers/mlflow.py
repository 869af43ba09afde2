"""`lightning.pytorch.loggers.mlflow`'s path for `MLFlowLogger` (external.py)."""

from fittrain.lightning.loggers.external import MLFlowLogger

__all__ = ["MLFlowLogger"]
