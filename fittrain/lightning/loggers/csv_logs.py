"""`lightning.pytorch.loggers.csv_logs`'s path for `CSVLogger` and its `ExperimentWriter` (files.py)."""

from fittrain.lightning.loggers.files import CSVLogger, ExperimentWriter

__all__ = ["CSVLogger", "ExperimentWriter"]
