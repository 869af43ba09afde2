"""The Trainer's run folders: `{project_dir}/checkpoints/{run_name}/checkpoint_{i}`.

Each run folder holds `run.json`, written atomically at the run's first save of each fit (a
fresh start or a resume), with a start number one above every other run's of the project. The
numbers, not folder times or names, order the runs, so `resume_from="latest"` means the newest
intact checkpoint of the run that started last among those holding one (`latest.latest_run_checkpoint`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import re

from fittrain.checkpoint.renames import fsync_dir
from fittrain.common.checks import is_int

CHECKPOINTS_DIR = "checkpoints"
RUN_FILE = "run.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint_[0-9]+")
_MAX_RUN_FILE = 4096  # bytes


def read_start(run_dir: pathlib.Path) -> int:
    """The start number in `run_dir`'s run.json; -1 when it is missing or unreadable, so such a
    folder ranks below every recorded run (it is still a candidate)."""
    try:
        with open(run_dir / RUN_FILE, "rb") as f:
            raw = f.read(_MAX_RUN_FILE + 1)
        # A few dozen bytes when fittrain writes it: anything large or deeply nested is not its file.
        value = json.loads(raw).get("start") if len(raw) <= _MAX_RUN_FILE else None
    except (OSError, ValueError, AttributeError, RecursionError):
        return -1
    return value if is_int(value) and value >= 0 else -1


def run_folders(root: pathlib.Path) -> list[pathlib.Path]:
    """The run folders under `root` (`{project_dir}/checkpoints`), the latest started first.

    Hidden folders and `checkpoint_{i}` folders (Accelerate's flat layout, a plain Accelerator's)
    are not runs. Equal start numbers (two runs started at once) are ordered by name, newest last.
    """
    if not root.is_dir():
        return []
    runs = [entry for entry in root.iterdir()
            if entry.is_dir() and not entry.name.startswith(".") and not _CHECKPOINT_NAME.fullmatch(entry.name)]
    return sorted(runs, key=lambda run: (read_start(run), run.name), reverse=True)


def record_run_start(run_dir: pathlib.Path) -> None:
    """Writes `run_dir/run.json` with a start number above every run's under its parent (main process).

    Written under a temporary name, fsynced and renamed, so a crash leaves the old file or the
    new one, never half of one.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    start = 1 + max((read_start(run) for run in run_folders(run_dir.parent)), default=-1)
    record = {"start": start, "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    temporary = run_dir / f".{RUN_FILE}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, run_dir / RUN_FILE)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    fsync_dir(run_dir)


def holds_checkpoints(folder: pathlib.Path) -> bool:
    """Whether `folder` holds any `checkpoint_{i}` folder (complete or not)."""
    return folder.is_dir() and any(_CHECKPOINT_NAME.fullmatch(entry.name) and entry.is_dir()
                                   for entry in folder.iterdir())


def run_folder(project_dir: str | os.PathLike[str], run_name: str | None = None) -> pathlib.Path:
    """A Trainer run's checkpoint folder, `{project_dir}/checkpoints/{run_name}`; without a name,
    the most recently started run's (which "latest" resumes when it holds an intact checkpoint).

    Example:
        >>> list_checkpoints(run_folder("runs/a"))  # that run's checkpoint_{i} folders, oldest first

    Raises:
        FileNotFoundError: when no run name is given and `{project_dir}/checkpoints` holds no run.
    """
    root = pathlib.Path(project_dir) / CHECKPOINTS_DIR
    if run_name is not None:
        return root / run_name
    runs = run_folders(root)
    if not runs:
        raise FileNotFoundError(f"No run folder under {root}: no Trainer run of this project has saved a checkpoint.")
    return runs[0]


def run_checkpoints(project_dir: str | os.PathLike[str], run_name: str | None = None) -> list[pathlib.Path]:
    """The `checkpoint_{i}` folders (complete or not) of a Trainer run, oldest first: of `run_name`,
    or of the most recently started run; empty when the project has no such run.

    Example:
        >>> run_checkpoints("runs/a")[-1]  # the newest folder of the run started last
    """
    from fittrain.checkpoint.naming import list_checkpoints  # naming imports this module

    try:
        return list_checkpoints(run_folder(project_dir, run_name))
    except FileNotFoundError:
        return []
