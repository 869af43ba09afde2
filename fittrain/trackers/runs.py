"""Run names: checking a given one, and choosing a new one free in the run's folders.

A run's name names its log folder and its checkpoint folder alike. This module takes plain values
and knows no Trainer (what a Trainer's run records is `fittrain.trainer.runs`).
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any

from fittrain.common.reprs import short_repr

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

