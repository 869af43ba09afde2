"""What a Lightning `Trainer(...)` builds from its arguments: the loggers, the Lightning callbacks
(with Lightning's defaults added), and the native callbacks that run them.

Lightning's defaults, kept:

- `logger=True` (or None): a `TensorBoardLogger(save_dir=default_root_dir)`, i.e.
  `{default_root_dir}/lightning_logs/version_{n}`; `False`: no logger.
- `enable_checkpointing=True`: a `ModelCheckpoint()` unless a `Checkpoint` is given (it saves at every
  epoch end into `{logger's log_dir}/checkpoints`, keeping the newest); False with one given is an
  error, as in Lightning.
- `enable_progress_bar=True`: a `TQDMProgressBar()` unless a `ProgressBar` is given (one of the
  program's own draws in its hooks; fittrain's bar is TQDMProgressBar's); `enable_model_summary=True`:
  a `ModelSummary()` unless one is given. False with one of them given is an error.
- Checkpoint callbacks run after the others (Lightning moves them to the end), so they save what
  EarlyStopping decided; the logger connector and `min_epochs` run last of all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from fittrain.callbacks.grad_clip import GradClip
from fittrain.callbacks.mixed_precision import MixedPrecision
from fittrain.common.reprs import short_repr
from fittrain.lightning.callbacks.base import Callback
from fittrain.lightning.callbacks.model_checkpoint import Checkpoint, ModelCheckpoint
from fittrain.lightning.callbacks.model_summary import ModelSummary
from fittrain.lightning.callbacks.progress import ProgressBar, TQDMProgressBar
from fittrain.lightning.connector import LoggerConnector, ManualSteps, MinimumLimits, Predictions
from fittrain.lightning.loggers.base import Logger
from fittrain.lightning.loggers.files import TensorBoardLogger
from fittrain.lightning.sharding import DistributedSampling
from fittrain.trainer.events import Callback as NativeCallback

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


def configure_loggers(logger: Any, default_root_dir: str) -> list[Logger]:
    """Lightning's `logger` argument as a list of loggers.

    Raises:
        TypeError: for anything but a bool, None, a fittrain.lightning logger or an iterable of them.
    """
    if logger is None or logger is True:
        return [TensorBoardLogger(save_dir=default_root_dir)]
    if logger is False:
        return []
    loggers = [logger] if isinstance(logger, Logger) else list(logger) if isinstance(logger, Iterable) else [logger]
    for item in loggers:
        if not isinstance(item, Logger):
            raise TypeError(f"Trainer(logger=...) takes True, False, a logger of fittrain.lightning.loggers "
                            f"(TensorBoardLogger, CSVLogger, WandbLogger, MLFlowLogger) or a list of them. Received: "
                            f"{short_repr(item)} ({type(item).__name__}).")
    return loggers


def lightning_callbacks(callbacks: Any, enable_checkpointing: bool, enable_progress_bar: bool,
                        enable_model_summary: bool) -> tuple[list[Callback], list[NativeCallback]]:
    """The Lightning callbacks (given, then the defaults; checkpoint callbacks last) and the native
    fittrain callbacks given beside them.

    Raises:
        TypeError: for an item that is neither.
        ValueError: for a default switched off while its callback is given, as in Lightning.
    """
    given = [] if callbacks is None else [callbacks] if not isinstance(callbacks, (list, tuple)) else list(callbacks)
    native = [cb for cb in given if isinstance(cb, NativeCallback)]
    ours = [cb for cb in given if isinstance(cb, Callback)]
    for cb in given:
        if not isinstance(cb, (Callback, NativeCallback)):
            raise TypeError(f"Trainer(callbacks=...) takes fittrain.lightning callbacks (subclasses of "
                            f"fittrain.lightning.Callback) or fittrain callbacks. Received: {short_repr(cb)} "
                            f"({type(cb).__name__}).")
    # As in Lightning, any Checkpoint or ProgressBar given (a subclass of one's own too) stands for the default.
    for kind, default, enabled, argument in (
            (Checkpoint, ModelCheckpoint, enable_checkpointing, "enable_checkpointing"),
            (ProgressBar, TQDMProgressBar, enable_progress_bar, "enable_progress_bar"),
            (ModelSummary, ModelSummary, enable_model_summary, "enable_model_summary")):
        present = next((cb for cb in ours if isinstance(cb, kind)), None)
        if present is not None and not enabled:
            raise ValueError(f"Trainer was configured with `{argument}=False` but found `{type(present).__name__}` in "
                             f"the callbacks list. Remove it, or pass {argument}=True.")
        if enabled and present is None:
            ours.append(default())
    checkpoints = [cb for cb in ours if isinstance(cb, ModelCheckpoint)]
    if len(checkpoints) > 1:
        raise ValueError(f"Trainer(callbacks=...) holds {len(checkpoints)} ModelCheckpoints; fittrain.lightning takes "
                         "one (the checkpoints of a run share one folder and one ranking). Keep one ModelCheckpoint: "
                         "it takes every_n_train_steps or every_n_epochs, monitor, save_top_k and save_last together.")
    return checkpoints_last(ours), native


def with_model_callbacks(callbacks: list[Callback], returned: Any, module_name: str) -> list[Callback]:
    """Lightning's merge of what a module's `configure_callbacks()` returned into the Trainer's callbacks:
    a returned callback replaces those of its class or a base class of it; checkpoint callbacks go last.

    Raises:
        TypeError: for a returned item that is not a fittrain.lightning callback.
        ValueError: when the result holds two ModelCheckpoints (fittrain.lightning takes one).
    """
    returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    for cb in returned:
        if not isinstance(cb, Callback):
            raise TypeError(f"{module_name}.configure_callbacks() must return fittrain.lightning callbacks (subclasses "
                            f"of fittrain.lightning.Callback). Received: {short_repr(cb)} ({type(cb).__name__}).")
    replaced = {kind for kind in {type(cb) for cb in callbacks} - {Callback}
                if any(issubclass(type(cb), kind) for cb in returned)}
    merged = [cb for cb in callbacks if type(cb) not in replaced] + returned
    checkpoints = [cb for cb in merged if isinstance(cb, ModelCheckpoint)]
    if len(checkpoints) > 1:
        raise ValueError(f"{module_name}.configure_callbacks() adds a ModelCheckpoint beside {len(checkpoints) - 1} "
                         "other(s); fittrain.lightning takes one. Return one ModelCheckpoint, of the Trainer's class "
                         "or a subclass of it, so that it replaces the Trainer's.")
    return checkpoints_last(merged)


def checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    """`callbacks` with the Checkpoints moved to the end, each group in its order (Lightning's order)."""
    return [cb for cb in callbacks if not isinstance(cb, Checkpoint)] + [cb for cb in callbacks
                                                                        if isinstance(cb, Checkpoint)]


def native_callbacks(trainer: "Trainer", callbacks: list[Callback], native: list[NativeCallback],
                     options: dict[str, Any], manual: bool = False) -> list[NativeCallback]:
    """The native callback list of the Lightning Trainer: the given native ones, the Lightning ones'
    natives in order, clipping and precision, then the connector, `min_*` limits and predictions; for
    a module with `manual` optimization, last, Lightning's count of its optimizer steps."""
    built: list[NativeCallback] = list(native)
    for callback in callbacks:
        built.extend(callback.native_callbacks(trainer))
    if options["gradient_clip_val"]:
        value = float(options["gradient_clip_val"])
        built.append(GradClip(max_value=value) if options["gradient_clip_algorithm"] == "value" else GradClip(value))
    if options["precision"] != "no":
        built.append(MixedPrecision(options["precision"]))
    built.append(DistributedSampling())
    built.append(LoggerConnector(trainer))
    built.append(trainer.optimizer_steps)
    if options["min_epochs"] or options["min_steps"]:
        built.append(MinimumLimits(options["min_epochs"], options["min_steps"]))
    built.append(trainer.predictions)
    if manual:
        built.append(ManualSteps(trainer.optimizer_steps))
    return built


__all__ = ["Predictions", "configure_loggers", "lightning_callbacks", "native_callbacks",
           "with_model_callbacks"]
