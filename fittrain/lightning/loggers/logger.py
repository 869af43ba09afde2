"""`lightning.pytorch.loggers.logger`'s path for the base class `Logger`, `DummyLogger` and
`rank_zero_experiment` (base.py)."""

from fittrain.lightning.loggers.base import DummyLogger, Logger, rank_zero_experiment

__all__ = ["DummyLogger", "Logger", "rank_zero_experiment"]
