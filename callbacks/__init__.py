"""fittrain's built-in callbacks, installed as the package `fittrain.callbacks`.

Example:
    >>> from fittrain.callbacks import Checkpointer, EarlyStop, GradClip, Logger, MixedPrecision

One class a module: checkpointer (its names, ranking and `last` link in checkpoint_names), early_stop,
grad_clip, logger (trackers), mixed_precision. `ProgressBar`
(the tqdm bars a Logger owns) is the Trainer's default display, so it lives in `fittrain.trainer.progress`
and is exported here. Callbacks may import `fittrain.trainer` and everything below it; the
Trainer layer never imports this package (a callback tells the Trainer what it needs through
`Callback.run_request`).
"""

from fittrain.trainer.progress import ProgressBar

from .checkpointer import Checkpointer
from .early_stop import EarlyStop
from .grad_clip import GradClip
from .logger import Logger
from .mixed_precision import MixedPrecision

__all__ = ["Checkpointer", "EarlyStop", "GradClip", "Logger", "MixedPrecision", "ProgressBar"]
