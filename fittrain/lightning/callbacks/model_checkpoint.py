"""`ModelCheckpoint`: Lightning's, saving through fittrain's `Checkpointer` (atomic, verified folders).

Lightning's defaults and names, kept: a save at every epoch end (`every_n_epochs=1` when no trigger is
given), or after each validation when validation runs several times an epoch or not every epoch
(`saves_at_epoch_end`), the name "{epoch}-{step}" -> "epoch=1-step=10", the newest save kept alone without a
`monitor` (`save_top_k=1`), `-1` keeping all and `0` none; `dirpath` by default
`{logger.save_dir}/{logger.name}/version_{n}/checkpoints` (the first logger's), or
`{default_root_dir}/checkpoints` without a logger, settled when the stage is set up; the attributes
`best_model_path`, `best_model_score`, `best_k_models`, `kth_best_model_path`, `last_model_path`.

Different, because fittrain's checkpoints are folders: "epoch=1-step=10.ckpt" is a folder (whose
`model.safetensors` holds the weights; `LightningModule.load_from_checkpoint` reads it); `last` is a
link to the newest folder; with a `monitor` the newest save is kept beside the k best (an exact resume needs
it). Not supported (refused when built): `save_weights_only=True`, `train_time_interval`,
`enable_version_counter=False`, `verbose=True`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from fittrain.callbacks.checkpoint_names import check_dirpath
from fittrain.callbacks.checkpointer import Checkpointer
from fittrain.common.reprs import short_repr
from fittrain.lightning.callbacks.base import Callback

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


def _refuse(argument: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"`ModelCheckpoint({argument}={short_repr(value)})` is not supported by fittrain.lightning. "
                      f"Instead: {fix}.")


class Checkpoint(Callback):
    """Lightning's base class of the callbacks that save checkpoints (`isinstance(cb, Checkpoint)` finds
    ModelCheckpoint, as in Lightning); a subclass of its own saves nothing through fittrain."""


class ModelCheckpoint(Checkpoint):
    """Lightning's `ModelCheckpoint`, mapped onto fittrain's `Checkpointer` (see the module docstring).

    Args:
        dirpath: The folder; None: Lightning's default, settled at setup.
        filename: A template such as "{epoch}-{val_loss:.2f}"; None: "{epoch}-{step}".
        monitor: The metric ranking the saves; None keeps the newest.
        verbose: Only False.
        save_last: True or "link": a `last` link to the newest save.
        save_top_k: The saves kept: k best (and the newest) with a monitor; 1 (the newest), -1 (all) or 0
            (none) without.
        save_weights_only: Only False (a checkpoint always holds the whole training state).
        mode: "min" or "max".
        auto_insert_metric_name: Write "name=" before each value of the template.
        every_n_train_steps: Save every n optimizer steps.
        train_time_interval: Only None.
        every_n_epochs: Save every n epochs (1 when no trigger is given).
        save_on_train_epoch_end: True saves at the training epoch's end, False after each validation;
            None: Lightning's rule (`saves_at_epoch_end`).
        enable_version_counter: Only True ("-v1", "-v2" for a name that exists).

    Raises:
        ValueError: for an argument fittrain.lightning does not support, or a bad value.
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1
    #: Lightning's naming attributes, set on the class or the instance, passed to the Checkpointer at setup.
    NAMING = ("CHECKPOINT_JOIN_CHAR", "CHECKPOINT_EQUALS_CHAR", "CHECKPOINT_NAME_LAST", "FILE_EXTENSION",
              "STARTING_VERSION")

    def __init__(self, dirpath: Any = None, filename: str | None = None, monitor: str | None = None,
                 verbose: bool = False, save_last: bool | str | None = None, save_top_k: int = 1,
                 save_weights_only: bool = False, mode: str = "min", auto_insert_metric_name: bool = True,
                 every_n_train_steps: int | None = None, train_time_interval: Any = None,
                 every_n_epochs: int | None = None, save_on_train_epoch_end: bool | None = None,
                 enable_version_counter: bool = True) -> None:
        for argument, value, default, fix in (
                ("verbose", verbose, False, "the progress bar's end line says where checkpoints went"),
                ("save_weights_only", save_weights_only, False, "every checkpoint holds the whole training state; "
                 "its model.safetensors alone holds the weights"),
                ("train_time_interval", train_time_interval, None, "use every_n_train_steps"),
                ("enable_version_counter", enable_version_counter, True, "a name that exists always gets -v1, -v2")):
            if value is not default and value != default:
                raise _refuse(argument, value, fix)
        if not isinstance(save_top_k, int) or isinstance(save_top_k, bool) or save_top_k < -1:
            raise ValueError(f"`ModelCheckpoint(save_top_k=...)` must be an int of at least -1. Received: "
                             f"save_top_k={short_repr(save_top_k)}.")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. "
                             "No quantity for top_k to track.")
        if every_n_train_steps and every_n_epochs:
            raise ValueError("Combination of parameters every_n_train_steps and every_n_epochs should be mutually "
                             "exclusive. Pass one of them.")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename, self.monitor, self.mode = filename, monitor, mode
        self.save_last, self.save_top_k = save_last, save_top_k
        self.auto_insert_metric_name, self.verbose = auto_insert_metric_name, verbose
        self.every_n_train_steps = every_n_train_steps or None
        self.every_n_epochs = every_n_epochs if every_n_epochs or every_n_train_steps else 1
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.native: Checkpointer | None = self._native() if save_top_k != 0 or save_last else None

    def _native(self) -> Checkpointer:
        top_k, monitored = self.save_top_k, self.monitor is not None
        return ModelCheckpointSaver(
            self,
            every_n_steps=self.every_n_train_steps, every_n_epochs=None if self.every_n_train_steps else
            self.every_n_epochs, monitor=self.monitor, mode=self.mode,
            save_top_k=top_k if monitored and top_k > 0 else None,
            total_limit=1 if not monitored and top_k == 1 else None, dirpath=self.dirpath,
            filename=self.filename if self.filename is not None else "{epoch}-{step}",
            save_last=bool(self.save_last), auto_insert_metric_name=self.auto_insert_metric_name)

    def native_callbacks(self, trainer: "Trainer") -> list[Any]:
        return [*([self.native] if self.native is not None else []), *super().native_callbacks(trainer)]

    def setup(self, trainer: "Trainer", pl_module: Any, stage: str) -> None:
        """Settles `dirpath` (Lightning's default, from the first logger) before the stage runs."""
        if stage == "fit" and self.native is not None:
            self.native.dirpath = check_dirpath(self.resolve_dirpath(trainer))
            self.dirpath = self.native.dirpath
            for name in self.NAMING:
                setattr(self.native, name, getattr(self, name))

    def saves_at_epoch_end(self, trainer: "Trainer") -> bool:
        """Lightning's rule for where an epoch's save happens: at the training epoch's end (True), or after
        each validation (False) when validation runs several times an epoch (`val_check_interval`) or
        not every epoch (`check_val_every_n_epoch`); `save_on_train_epoch_end` decides when given."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        return sum(trainer.num_val_batches) == 0 or trainer.val_check_interval == 1.0

    def resolve_dirpath(self, trainer: "Trainer") -> str:
        """`dirpath`, or Lightning's default folder for `trainer`'s first logger."""
        if self.dirpath is not None:
            return self.dirpath
        if trainer.loggers:
            logger = trainer.loggers[0]
            version = logger.version
            version = version if isinstance(version, str) else f"version_{version}"
            return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name or ""), version,
                                "checkpoints")
        return os.path.join(trainer.default_root_dir, "checkpoints")

    # ----------------------------------------------------------------- Lightning's attributes
    def _read(self, name: str, default: Any) -> Any:
        return getattr(self.native, name, default) if self.native is not None else default

    @property
    def best_model_path(self) -> str:
        return self._read("best_model_path", "") or ""

    @property
    def best_model_score(self) -> torch.Tensor | None:
        score = self._read("best_model_score", None)
        return None if score is None else torch.tensor(float(score))

    @property
    def best_k_models(self) -> dict[str, torch.Tensor]:
        return {path: torch.tensor(float(score)) for path, score in (self._read("best_k_models", {}) or {}).items()}

    @property
    def kth_best_model_path(self) -> str:
        return self._read("kth_best_model_path", "") or ""

    @property
    def last_model_path(self) -> str:
        return self._read("last_model_path", "") or ""

    def __repr__(self) -> str:
        return (f"ModelCheckpoint(dirpath={self.dirpath!r}, filename={self.filename!r}, monitor={self.monitor!r}, "
                f"save_top_k={self.save_top_k})")


class ModelCheckpointSaver(Checkpointer):
    """The Checkpointer of a `ModelCheckpoint` (named so that an error raised in its hooks says whose):
    its epoch trigger saves where Lightning's does (`ModelCheckpoint.saves_at_epoch_end`), monitored
    or not: at the training epoch's end, or after each validation of a fit (not the sanity check's)
    in every `every_n_epochs`-th epoch. A second save at one global step is skipped, as in Lightning."""

    # A missing monitored metric is refused in the program's terms; ModelCheckpoint saves after
    # validations by default, so there is no further fix to suggest.
    monitor_refusal = ("`ModelCheckpoint(monitor=...)`", "")

    def __init__(self, owner: ModelCheckpoint, **options: Any) -> None:
        super().__init__(**options)
        self._owner = owner

    def saves_after_validation(self, trainer: "Trainer") -> bool:
        return not self._owner.saves_at_epoch_end(trainer)
