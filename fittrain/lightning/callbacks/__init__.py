"""`lightning.pytorch.callbacks`' names, mapped onto fittrain's callbacks.

    Callback             Lightning's base class (hooks take trainer, pl_module, ...)  base.py
    ModelCheckpoint      -> fittrain.callbacks.Checkpointer (a Checkpoint)           model_checkpoint.py
    EarlyStopping        -> fittrain.callbacks.EarlyStop, Lightning's check points    early_stopping.py
    LearningRateMonitor  lr-<Optimizer> to the loggers                                lr_monitor.py
    ModelSummary         the parameter table (fittrain.trainer.summary)               model_summary.py
    TQDMProgressBar      -> fittrain's ProgressBar (a ProgressBar)                    progress.py
    Lightning's others   importable; building one raises, naming the fittrain way    ../missing.py

Lightning's paths `callbacks.callback` (Callback) and `callbacks.checkpoint` (Checkpoint) import too.
"""

from fittrain.lightning.callbacks.base import Callback
from fittrain.lightning.callbacks.early_stopping import EarlyStopping
from fittrain.lightning.callbacks.lr_monitor import LearningRateMonitor
from fittrain.lightning.callbacks.model_checkpoint import Checkpoint, ModelCheckpoint
from fittrain.lightning.callbacks.model_summary import ModelSummary
from fittrain.lightning.callbacks.progress import ProgressBar, TQDMProgressBar
from fittrain.lightning.missing import CALLBACKS, missing

# Lightning's other names: importable, and refused where built, naming the fittrain way (missing.py).
globals().update(missing(CALLBACKS, __name__))

__all__ = ["Callback", "Checkpoint", "EarlyStopping", "LearningRateMonitor", "ModelCheckpoint", "ModelSummary",
           "ProgressBar", "TQDMProgressBar"]
