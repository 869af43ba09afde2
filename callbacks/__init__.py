"""fittrain's built-in callbacks, installed as the package `fittrain.callbacks`.

Example:
    >>> from fittrain.callbacks import Checkpointer, EarlyStop, GradClip, Logger, MixedPrecision

One class a module: checkpointer, early_stop, grad_clip, logger (trackers), progress (the tqdm bars a
Logger owns), mixed_precision. Callbacks may import `fittrain.trainer` and everything below it; the
Trainer layer never imports this package (a callback tells the Trainer what it needs through
`Callback.run_request`).
"""

from .checkpointer import Checkpointer
from .early_stop import EarlyStop
from .grad_clip import GradClip
from .logger import Logger
from .mixed_precision import MixedPrecision
from .progress import ProgressBar

__all__ = ["Checkpointer", "EarlyStop", "GradClip", "Logger", "MixedPrecision", "ProgressBar"]
