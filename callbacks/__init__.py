"""fittrain's built-in callbacks, installed as the package `fittrain.callbacks`.

Example:
    >>> from fittrain.callbacks import Checkpointer, EarlyStop, GradClip, Logger, MixedPrecision
"""

from .checkpointer import Checkpointer
from .early_stop import EarlyStop
from .grad_clip import GradClip
from .logger import Logger
from .mixed_precision import MixedPrecision

__all__ = ["Checkpointer", "EarlyStop", "GradClip", "Logger", "MixedPrecision"]
