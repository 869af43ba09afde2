"""Runs: run names (a Trainer's run names its log folder and its checkpoint folder alike), and the
hyperparameters a Trainer run is given."""

from __future__ import annotations

import datetime
import os
import re
from typing import TYPE_CHECKING, Any

from fittrain.common.reprs import short_repr

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

#: Characters a run name may use: it names a folder, a wandb run id and an mlflow run alike.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_name(run_name: Any, owner: str = "Logger") -> str | None:
    """Returns `run_name` (None, or a name usable as a folder and a tracker's run id).

    Args:
        run_name: The value received.
        owner: Whose argument it is, for the message ("Logger", "Trainer").

    Raises:
        ValueError: for anything else.
    """
    if run_name is None or (isinstance(run_name, str) and _RUN_NAME.fullmatch(run_name)):
        return run_name
    raise ValueError(f"`{owner}(run_name=...)` must be None or a name of letters, digits, '.', '_' and '-' (at most "
                     f"128, starting with a letter or digit), as it names the run's folders. Received: "
                     f"run_name={short_repr(run_name)}. Pass e.g. run_name='baseline-lr3e-4'.")


def new_run_name(*folders: str | os.PathLike, now: datetime.datetime | None = None) -> str:
    """`run_YYYY-MM-DD_HH-MM-SS` (local time), with `_2`, `_3`, ... while that name exists in any of
    `folders` (a run's logs folder and its checkpoints folder carry the same name)."""
    stamp = (now or datetime.datetime.now()).strftime("run_%Y-%m-%d_%H-%M-%S")
    name, suffix = stamp, 1
    while any(os.path.lexists(os.path.join(folder, name)) for folder in folders):
        suffix += 1
        name = f"{stamp}_{suffix}"
    return name


def trainer_hparams(trainer: "Trainer", extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a run was given: the Trainer's arguments, the module's `hparams` dict (if it has one),
    then the Logger's `hparams`, later ones winning on equal names."""
    acc = trainer.accelerator
    values: dict[str, Any] = {
        "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
        "gradient_accumulation_steps": acc.gradient_accumulation_steps,
        "val_every_n_epochs": trainer.val_every_n_epochs, "val_every_n_steps": trainer.val_every_n_steps,
        "strategy": acc.strategy, "precision": acc.mixed_precision, "num_processes": acc.num_processes,
        "callbacks": ", ".join(short_repr(cb, 200) for cb in trainer.callbacks),
    }
    optimizers = getattr(trainer, "optimizers", None) or [trainer.optimizer]
    values["optimizer"] = ", ".join(type(getattr(o, "optimizer", o)).__name__ for o in optimizers if o is not None)
    module_hparams = getattr(trainer.module, "hparams", None)
    if isinstance(module_hparams, dict):
        values.update(module_hparams)
    values.update(extra or {})
    return values
