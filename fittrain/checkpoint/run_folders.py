"""The folders checkpoints live in: their runs, the order of their saves, and the `last` link.

A Trainer run's folder is `{project_dir}/checkpoints/{run_name}` (or a Checkpointer's `dirpath`).
Each run folder holds `run.json`, written atomically at the run's first save of each fit (a
fresh start or a resume), with a start number one above every other run's of the project. The
numbers, not folder times or names, order the runs, so `resume_from="latest"` means the newest
intact checkpoint of the run that started last among those holding one (`latest.latest_run_checkpoint`).

Within a folder, `checkpoint_{i}` folders are ordered by their number. Folders named by a
template (`Checkpointer(filename="{epoch}-{val_loss:.3f}")`) cannot be: "epoch=10" sorts before
"epoch=9". So the folder's `saves.json` lists its saves in the order they were made, with the run
that made each; the main process adds a name when it reserves it, before the checkpoint is
written, so a committed checkpoint is always listed (`record_save`; a failed save leaves a name
whose folder never appears, which is skipped). `saved_in_order` reads it; a folder it does not list
(its file lost, or written by an older version) counts as older than every listed one, ordered by
the data position its accelerator_state.json records.

`point_link` makes `last` (a Checkpointer's `save_last`) a symbolic link to the newest save,
replaced in one rename, so it never dangles or holds half a checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import re
import secrets
import shutil
from typing import Any

from fittrain.checkpoint.fastio import MANIFEST_NAME
from fittrain.checkpoint.renames import commit_replacing, fsync_dir
from fittrain.common.checks import is_int

CHECKPOINTS_DIR = "checkpoints"
RUN_FILE = "run.json"
SAVES_FILE = "saves.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint_[0-9]+")
_MAX_RUN_FILE = 4096  # bytes
_MAX_SAVES_FILE = 16 * 1024 * 1024  # bytes: a few hundred thousand saves
_SAVES_FORMAT = "fittrain-saves"
# snapshot.META_NAME: the data position it holds orders folders that saves.json does not list.
_META_NAME = "accelerator_state.json"
_MAX_NAME = 200  # bytes: room for ".{name}.tmp" and other siblings' suffixes within 255


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
    _write_json(run_dir / RUN_FILE, record)


def _write_json(path: pathlib.Path, value: Any) -> None:
    """Writes `value` to `path` atomically: a temporary file, fsynced, renamed over it, the folder fsynced."""
    temporary = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    fsync_dir(path.parent)


def is_plain_name(name: Any) -> bool:
    """Whether `name` can name a checkpoint folder: one path component, not hidden, not too long.

    Hidden names are the temporary folders' and files' (`.checkpoint_3.tmp`); a separator or
    '..' would put the folder elsewhere.
    """
    return (isinstance(name, str) and name not in ("", ".", "..") and not name.startswith(".")
            and not any(sep in name for sep in ("/", "\\", "\0")) and len(os.fsencode(name)) <= _MAX_NAME)


def is_numbered(name: str) -> bool:
    """Whether `name` is an automatic checkpoint folder's name, `checkpoint_{i}`."""
    return _CHECKPOINT_NAME.fullmatch(name) is not None


def read_saves(folder: pathlib.Path) -> list[tuple[str, str | None]]:
    """The saves `folder/saves.json` lists, oldest first: (folder name, the run that saved it or None).

    A missing, unreadable or foreign file lists nothing; entries that are not plain names are
    left out. A name saved twice (a deleted folder's name taken again) is listed at its last save.
    """
    try:
        with open(folder / SAVES_FILE, "rb") as f:
            raw = f.read(_MAX_SAVES_FILE + 1)
        data = json.loads(raw) if len(raw) <= _MAX_SAVES_FILE else None
    except (OSError, ValueError, RecursionError):
        return []
    listed = data.get("saves") if isinstance(data, dict) and data.get("format") == _SAVES_FORMAT else None
    saves: dict[str, str | None] = {}
    for item in listed if isinstance(listed, list) else []:
        name = item.get("name") if isinstance(item, dict) else None
        if is_plain_name(name):
            run = item.get("run")
            saves.pop(name, None)  # a re-used name counts at its last save
            saves[name] = run if isinstance(run, str) else None
    return list(saves.items())


def record_save(folder: pathlib.Path, name: str, run: str | None) -> None:
    """Lists `name` as the newest save of `folder` in its saves.json, made by `run` (main process).

    Called when the name is reserved, before the checkpoint is written: so every committed
    checkpoint is listed, even after a crash right after its commit. Entries whose folder and
    temporary folder are both gone (deleted checkpoints, failed saves) are dropped.
    """
    kept = [(old, by) for old, by in read_saves(folder)
            if old != name and (os.path.lexists(folder / old) or os.path.lexists(folder / f".{old}.tmp"))]
    saves = [{"name": old, "run": by} for old, by in [*kept, (name, run)]]
    _write_json(folder / SAVES_FILE, {"format": _SAVES_FORMAT, "version": 1, "saves": saves})


def saved_by(folder: pathlib.Path, name: str) -> str | None:
    """The run that saved `folder/name`, as saves.json records it; None when it is not listed."""
    return dict(read_saves(folder)).get(name)


def saved_in_order(folder: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint folders directly under `folder`, complete or not, in the order they were saved.

    Candidates are `checkpoint_{i}` folders, folders saves.json lists, and other folders holding a
    manifest; hidden names and links (`last`) are not. Those saves.json lists come last, in its
    order; the others before them, by the data position their accelerator_state.json holds, then
    by number and name. Without saves.json, `checkpoint_{i}` folders are simply in number order.

    Returns:
        Oldest first; empty when `folder` does not exist.
    """
    try:
        entries = [entry for entry in os.scandir(folder)
                   if is_plain_name(entry.name) and not entry.is_symlink() and entry.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    position = {name: i for i, (name, _) in enumerate(read_saves(folder))}
    found = [pathlib.Path(entry.path) for entry in entries if entry.name in position or is_numbered(entry.name)
             or os.path.isfile(os.path.join(entry.path, MANIFEST_NAME))]
    if not position and all(is_numbered(path.name) for path in found):
        return sorted(found, key=_number)
    return sorted(found, key=lambda path: (1, position[path.name]) if path.name in position
                  else (0, _saved_position(path), _number(path), path.name))


def _number(path: pathlib.Path) -> int:
    return int(path.name[len("checkpoint_"):]) if is_numbered(path.name) else -1


def _saved_position(checkpoint: pathlib.Path) -> list[tuple[int, int]]:
    """How far a checkpoint's data loaders were, (epoch, batches consumed) each, as its
    accelerator_state.json records them (the training loader first, in a Trainer's); [] when unreadable.
    Within a run, a later save is further."""
    try:
        with open(checkpoint / _META_NAME, "rb") as f:
            raw = f.read(_MAX_SAVES_FILE + 1)
        loaders = json.loads(raw).get("dataloaders") if len(raw) <= _MAX_SAVES_FILE else None
        return [(int(loader["epoch"]), int(loader["batches_consumed"])) for loader in loaders]
    except (OSError, ValueError, AttributeError, RecursionError, TypeError, KeyError):
        return []


def holds_checkpoints(folder: pathlib.Path) -> bool:
    """Whether `folder` holds any checkpoint folder (complete or not), or a saves.json listing them."""
    return folder.is_dir() and ((folder / SAVES_FILE).is_file() or bool(saved_in_order(folder)))


def point_link(folder: pathlib.Path, link: str, target: str) -> None:
    """Makes `folder/link` lead to the checkpoint `folder/target`, replacing what `link` led to.

    `link` becomes a relative symbolic link, made under a temporary name and renamed over the
    old one: at every moment `link` leads to a complete checkpoint (the old one or the new one),
    and nothing is copied. Where links cannot be made (Windows without the privilege), the
    checkpoint is copied to a temporary sibling and swapped in (`renames.commit_replacing`).

    Raises:
        FileExistsError: when `link` names something that is neither a link nor a checkpoint
            (never replaced).
    """
    final = folder / link
    if os.path.lexists(final) and not final.is_symlink() and not (final / MANIFEST_NAME).is_file():
        raise FileExistsError(f"Cannot point {str(final)!r} at checkpoint {target!r}: something of that name "
                              "exists that is neither a link nor a checkpoint, and it is never replaced. Rename "
                              "or remove it.")
    temporary = folder / f".{link}.{os.getpid()}-{secrets.token_hex(4)}.link"
    try:
        os.symlink(target, temporary, target_is_directory=True)
    except OSError:
        _copy_into_place(folder / target, final, temporary)
        return
    try:
        if final.is_symlink() or not os.path.lexists(final):
            os.replace(temporary, final)  # one rename(2): the old link or the new, never neither
        else:
            commit_replacing(temporary, final)  # a copy made where links could not be: swapped out
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    fsync_dir(folder)


def _copy_into_place(source: pathlib.Path, final: pathlib.Path, temporary: pathlib.Path) -> None:
    """The fallback of `point_link`: a full copy (manifest included) swapped in whole."""
    try:
        shutil.copytree(source, temporary)
        commit_replacing(temporary, final)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def link_targets(folder: pathlib.Path) -> set[str]:
    """The names of the checkpoints that links in `folder` lead to (those `point_link` made)."""
    try:
        links = [entry.path for entry in os.scandir(folder) if entry.is_symlink()]
    except (FileNotFoundError, NotADirectoryError):
        return set()
    targets = set()
    for link in links:
        with contextlib.suppress(OSError):
            targets.add(os.path.basename(os.path.normpath(os.readlink(link))))
    return targets


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
