"""The Lightning Trainer's read-only attributes a program reads: metrics, loop counters, loaders and
limits, processes, loggers and callbacks, each mapped onto the native Trainer's state (a mixin of
`Trainer`); those it lacks (`strategy`, `fit_loop`, ...) are an AttributeError naming the fittrain way."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from fittrain.lightning.callbacks.early_stopping import EarlyStopping
from fittrain.lightning.callbacks.model_checkpoint import ModelCheckpoint
from fittrain.lightning.callbacks.progress import ProgressBar
from fittrain.lightning.loggers.files import CSVLogger, TensorBoardLogger

if TYPE_CHECKING:
    from fittrain.lightning.loggers.base import Logger


class LightningAttributes:
    """Lightning's Trainer attributes over the native state; see the Trainer's docstring for what differs."""

    # ----------------------------------------------------------------- metrics (fittrain/lightning/metrics.py)
    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """What `self.log` recorded in this run, by name (`x`, `x_step`, `x_epoch`), as tensors."""
        return self.logged_names.callback_metrics(self.state.raw_metrics)

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """The names logged with logger=True (`x`, or `x_step` and `x_epoch`), as tensors."""
        return self.logged_names.logged_metrics(self.state.raw_metrics)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """The names logged with prog_bar=True, as floats."""
        return self.logged_names.progress_bar_metrics(self.state.raw_metrics)

    def logs_at_next_step(self) -> bool:
        """Whether the loggers get a row after the coming optimizer step (Lightning's `should_update_logs`)."""
        every = self.log_every_n_steps
        return bool(every) and ((self.state.global_step + 1) % every == 0 or self.state.should_stop)

    def add_callback_metrics(self, values: dict[str, torch.Tensor]) -> None:
        """Puts `values` into `callback_metrics` (what Lightning's callbacks do with `.update`)."""
        self.logged_names.extra.update(values)

    # ----------------------------------------------------------------- the loop
    @property
    def current_epoch(self) -> int:
        """The epoch being trained (the epochs completed, after fit)."""
        return self.state.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken, as Lightning counts them: one per accumulation window in automatic
        optimization; each optimizer's `step()` in manual optimization."""
        module = self._lightning_module
        if module is not None and not module.automatic_optimization and self.optimizer_steps.count:
            return self.optimizer_steps.count
        return self.state.global_step

    @property
    def should_stop(self) -> bool:
        """Set True to stop training at the end of this epoch (or after a mid-epoch validation)."""
        return self.state.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.state.should_stop = bool(value)

    @property
    def lightning_module(self) -> Any:
        """The module of the current (or last) stage."""
        return self._lightning_module

    @property
    def datamodule(self) -> Any:
        """The datamodule of the current (or last) stage, or None."""
        return self._datamodule

    # Lightning's readings of the stage (trainer.state.fn and .stage: fittrain/lightning/trainer/states.py).
    @property
    def started_stage(self) -> str | None:
        """The stage last started ("fit", "validate", "test", "predict"), kept after it ends; None before any."""
        return self._stage

    @property
    def running_stage(self) -> str | None:
        """What runs now: "train", "sanity_check" or "validate" in a fit, else the stage; None between stages."""
        if not self._running:
            return None
        if self._stage == "fit":
            return "sanity_check" if self.sanity_checking else "validate" if self.evaluation.running else "train"
        return self._stage

    @property
    def fitting(self) -> bool:
        return self._stage == "fit"

    @property
    def training(self) -> bool:
        return self.running_stage == "train"

    @property
    def validating(self) -> bool:
        return self.running_stage == "validate"

    @property
    def testing(self) -> bool:
        return self.running_stage == "test"

    @property
    def predicting(self) -> bool:
        return self.running_stage == "predict"

    @property
    def evaluating(self) -> bool:
        return self.running_stage in ("validate", "test", "sanity_check")

    @property
    def checks_validation_every_epoch(self) -> bool:
        """Lightning's test for checking at epoch ends: val_check_interval 1.0, check_val_every_n_epoch 1."""
        return self.val_check_interval == 1.0 and self.check_val_every_n_epoch == 1

    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps the fit will take (Lightning's: from max_steps, else the epochs' batches)."""
        if self.max_steps:
            return self.max_steps
        batches = self._training_batches()
        if self.max_epochs is None or batches is None:
            return math.inf
        return math.ceil(batches / self.accumulate_grad_batches) * self.max_epochs

    def _training_batches(self) -> int | None:
        known = getattr(self, "num_training_batches", None)
        if isinstance(known, int) and known > 0:
            return known
        loader = getattr(self.data, "last_train_loader", None)
        try:
            length = len(loader)
        except TypeError:
            return None
        return math.ceil(length / self.accelerator.num_processes)

    # ----------------------------------------------------------------- data
    @property
    def train_dataloader(self) -> Any:
        """The fit's training loader, as prepared (its length, dataset and batch_size are the loader's);
        None before a fit."""
        return getattr(self, "train_loader", None)

    @property
    def val_dataloaders(self) -> Any:
        """The fit's validation loader, as prepared; None without one."""
        return getattr(self, "val_loader", None)

    # Lightning counts an evaluation's batches per dataloader: a list, empty without a loader.
    num_val_batches = property(lambda self: _per_loader(self.loops.num_val_batches),
                               doc="Batches per validation, per dataloader (Lightning's list).")
    num_sanity_val_batches = property(lambda self: _per_loader(self.loops.num_sanity_val_batches),
                                      doc="Sanity-check batches, per dataloader (Lightning's list).")
    num_test_batches = property(lambda self: _per_loader(self.loops.num_test_batches),
                                doc="Batches of the last test, per dataloader (Lightning's list).")
    num_predict_batches = property(lambda self: _per_loader(self.loops.num_predict_batches),
                                   doc="Batches of the last predict, per dataloader (Lightning's list).")

    @property
    def limit_train_batches(self) -> int | float:
        return _limit(self.limits.train)

    @property
    def limit_val_batches(self) -> int | float:
        return _limit(self.limits.val)

    @property
    def limit_test_batches(self) -> int | float:
        return _limit(self.limits.test)

    @property
    def limit_predict_batches(self) -> int | float:
        return _limit(self.limits.predict)

    # ----------------------------------------------------------------- processes
    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def global_rank(self) -> int:
        return self.accelerator.process_index

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_process_index

    @property
    def node_rank(self) -> int:
        return self.accelerator.process_index // max(self.num_devices, 1)

    @property
    def is_global_zero(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device_ids(self) -> list[int]:
        device = self.accelerator.device
        return [device.index if device.index is not None else 0]

    # ----------------------------------------------------------------- loggers and callbacks
    @property
    def callbacks(self) -> list[Any]:
        """The Lightning callbacks, in the order they run (Lightning's defaults included; checkpoint
        callbacks last); `events.callbacks` holds the native callbacks that run them."""
        return self.lightning_callbacks

    @property
    def loggers(self) -> "list[Logger]":
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: "list[Logger]") -> None:
        self._loggers = list(loggers)

    @property
    def logger(self) -> "Logger | None":
        """The first logger, or None."""
        return self._loggers[0] if self._loggers else None

    @property
    def log_dir(self) -> str | None:
        """The first logger's folder (its `log_dir` for TensorBoard and CSV, else its `save_dir`: None for
        a logger of the program's own that has none, as in Lightning), or `default_root_dir` without a
        logger."""
        if not self._loggers:
            return self.default_root_dir
        logger = self._loggers[0]
        self.settle_logger_versions()
        folder = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
        return None if folder is None else os.fspath(folder)

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.lightning_callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ModelCheckpoint, or None."""
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        return [cb for cb in self.lightning_callbacks if isinstance(cb, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        return next((cb for cb in self.lightning_callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """The schedulers `configure_optimizers` returned, with their "name" and "interval" (Lightning's
        LRSchedulerConfig), as the LightningModule recorded them."""
        module = self._lightning_module
        return list(getattr(module, "lr_scheduler_configs", [])) if module is not None else []

    # ----------------------------------------------------------------- what fittrain.lightning lacks
    def __getattr__(self, name: str) -> Any:
        """Only for an attribute not found: a Lightning Trainer attribute fittrain.lightning lacks is an
        AttributeError naming the fittrain way, not Python's bare one."""
        way = _ABSENT.get(name)
        if way is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(f"fittrain.lightning's Trainer has no {name!r} (Lightning's Trainer.{name}): {way}. "
                             "docs/migration.md lists every Lightning name.")


_LOOPS = ("fittrain's loop is not a tree of loop objects: its counters are trainer.state (epoch, global_step, "
          "batch_idx), as current_epoch and global_step show them")
_EVAL_LOADER = "a test or predict loader is the one passed to trainer.test(...) or trainer.predict(...)"
#: Lightning Trainer attributes fittrain.lightning does not have, with the fittrain way to get what they give.
_ABSENT = {
    "strategy": "fittrain has no strategy object; trainer.accelerator does its work (wait_for_everyone() for "
                "barrier(), reduce(), gather(), device for root_device)",
    "fit_loop": _LOOPS, "validate_loop": _LOOPS, "test_loop": _LOOPS, "predict_loop": _LOOPS,
    "test_dataloaders": _EVAL_LOADER, "predict_dataloaders": _EVAL_LOADER,
    "ckpt_path": "while fit(ckpt_path=...) runs, the checkpoint folder it resumed from is trainer.resume_from",
    "is_last_batch": "compare trainer.state.batch_idx + 1 with trainer.num_training_batches",
    "received_sigterm": "fittrain itself saves a checkpoint and exits with 75 on SIGTERM or SIGUSR1 "
                        "(docs/resume.md)",
    "interrupted": "a fit that raised re-raises; nothing is left to inspect",
    "tuner": "Lightning's Tuner is not in fittrain: choose the batch size and learning rate yourself",
}


def _limit(limit: Any) -> int | float:
    """A loop's limit as Lightning shows it: 1.0 (every batch) when there is none."""
    return 1.0 if limit is None else limit


def _per_loader(batches: int | float) -> list[int | float]:
    """A loop's batch count as Lightning lists it, one entry per dataloader (fittrain runs one; none: [])."""
    return [batches] if batches else []
