"""Automatic checkpoint names: `ProjectConfiguration`, numbering or naming, reservation and pruning.

With automatic naming, `save_state()` writes `{project_dir}/checkpoints/checkpoint_{i}` (the
Trainer points it at its run's folder, `{project_dir}/checkpoints/{run_name}/checkpoint_{i}`,
with `use_run`, or at a Checkpointer's `dirpath` with `use_folder`: numbering, pruning and
"latest" then stay inside that folder). A save may be given a name instead of a number
(`name_next`, a Checkpointer's `filename` template): the first of its candidate names that is
free (`name`, `name-v1`, ... as Lightning versions them). The main process reserves the number or
name (`reserve_target`, through `temp_folders`), so writers sharing a folder never pick the same
one, and lists a named save in the folder's saves.json (`run_folders.record_save`), which orders
saves that names cannot. `ProjectConfiguration.prune` deletes this run's oldest folders beyond
`total_limit`, hiding each under a temporary name first (`delete_checkpoints` does the same for
named folders, for `Checkpointer(save_top_k=...)`), and never one a link such as `last` leads to.
`list_checkpoints` lists the numbered folders, complete or not; `latest` picks the loadable one.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
from typing import Any, Callable, Iterable, Iterator

from fittrain.checkpoint.errors import CheckpointError
from fittrain.checkpoint.fastio import MANIFEST_NAME
from fittrain.checkpoint.run_folders import (
    CHECKPOINTS_DIR,
    SAVES_FILE,
    is_numbered,
    is_plain_name,
    link_targets,
    read_saves,
    record_run_start,
    record_save,
    saved_in_order,
)
from fittrain.checkpoint.temp_folders import TempFolder, raise_if_no_space, reserve_numbered
from fittrain.common.checks import check_non_negative_int, check_positive_int

PREFIX = "checkpoint_"


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project keeps its checkpoints and logs, and how checkpoints are named.

    With `automatic_checkpoint_naming`, `save_state()` writes
    `{project_dir}/checkpoints/checkpoint_{iteration}`, keeps at most `total_limit` of them, and
    `load_state()` loads the newest complete one.

    Args:
        project_dir: Root folder of the project; defaults to the working directory.
        logging_dir: Where trackers write; defaults to `project_dir`, as in Accelerate.
        automatic_checkpoint_naming: Name checkpoint folders automatically.
        total_limit: Keep at most this many automatic checkpoints (oldest are deleted).
        iteration: Number of the next automatic checkpoint.
        save_on_each_node: Accepted for Accelerate compatibility; fittrain writes shared files once.

    Attributes:
        run_name: Set by the Trainer (`use_run`), never by users: the run folder under
            `checkpoints/` that automatic names go into. None (a plain Accelerator) keeps
            Accelerate's flat layout.
        folder: Set by a Checkpointer with `dirpath` (`use_folder`): the folder automatic saves
            go into instead of the run's.
        saving: The folder name of the save in progress, from its reservation on (every process).
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    run_name: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    folder: pathlib.Path | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    saving: str | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # Whether this run's start was recorded in its folder (`run_folders`), once per fit.
    _run_recorded: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    # The candidate names of the next save (`name_next`), consumed by its reservation.
    _next_names: Iterator[str] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive_int(
            "total_limit", self.total_limit, owner="ProjectConfiguration", optional=True,
            wanted="a positive int (the number of automatic checkpoints to keep) or None",
            fix="Pass e.g. total_limit=3 to keep the newest three, or None to keep all.")
        # A negative number would name a folder (`checkpoint_-3`) that "latest" never finds.
        check_non_negative_int(
            "iteration", self.iteration, owner="ProjectConfiguration",
            wanted="an int >= 0, the number of the next automatic checkpoint",
            fix="Pass 0 to start from checkpoint_0 (existing checkpoints are never overwritten).")
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Sets `project_dir` and derives `logging_dir` from it when none was given."""
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        if self.logging_dir is None and self.project_dir is not None:
            self.logging_dir = self.project_dir

    @property
    def checkpoints_root(self) -> pathlib.Path:
        """`{project_dir}/checkpoints`: the flat layout's folder, and the one holding run folders."""
        return pathlib.Path(self.project_dir or ".") / CHECKPOINTS_DIR

    @property
    def checkpoints_dir(self) -> pathlib.Path:
        """The folder that holds automatically named checkpoints: `folder`, else the run's folder
        when one is set, else `checkpoints/`."""
        if self.folder is not None:
            return self.folder
        root = self.checkpoints_root
        return root / self.run_name if self.run_name is not None else root

    def use_run(self, run_name: str) -> None:
        """Points automatic naming at `checkpoints/{run_name}`, numbering from 0 there (the Trainer
        calls it at each fit; a resumed checkpoint's number then moves `iteration` on)."""
        self.run_name, self.iteration, self._run_recorded = run_name, 0, False
        self.folder, self._next_names, self.saving = None, None, None

    def use_folder(self, folder: str | os.PathLike | None) -> None:
        """Points automatic saves at `folder` (a Checkpointer's `dirpath`) for this fit; None: the run's folder."""
        self.folder = None if folder is None else pathlib.Path(os.path.abspath(folder))

    def name_next(self, names: Iterable[str]) -> None:
        """Names the next automatic save: the first of `names` (plain folder names) that is free."""
        self._next_names = iter(names)

    def next_checkpoint_dir(self) -> pathlib.Path:
        """The folder for the next automatic save; never one that already exists."""
        existing = [int(p.name[len(PREFIX):]) for p in list_checkpoints(self.checkpoints_dir, PREFIX)]
        self.iteration = max([self.iteration, *(i + 1 for i in existing)])
        return self.checkpoints_dir / f"{PREFIX}{self.iteration}"

    def reserve_next_checkpoint(self) -> TempFolder:
        """Claims the temporary folder of the next automatic checkpoint (on the main process).

        Without a name (`name_next`), the number is the first from `next_checkpoint_dir()`'s on
        that neither names a folder nor is being written by another live writer (another job,
        another Accelerator), so writers sharing the project never pick the same number;
        `iteration` moves past it. With one, the first free candidate name. A named save (and any
        save into a folder that lists its saves) is listed in the folder's saves.json first.

        Returns:
            The claimed folder, `.{name}.tmp`; its `number` names a numbered checkpoint. Commit it
            with `write_checkpoint`, or `release()` it.
        """
        names, self._next_names = self._next_names, None
        folder = self.checkpoints_dir
        if self.run_name is not None and self.folder is None and not self._run_recorded:
            # Recorded at the run's first save of a fit, so "latest" knows which run started last.
            record_run_start(folder)
            self._run_recorded = True
        if names is None:
            self.next_checkpoint_dir()  # moves `iteration` past the existing folders
            reserved = reserve_numbered(folder, PREFIX, self.iteration)
            self.iteration = reserved.number + 1
            # A Checkpointer's dirpath may hold others' folders: only listed saves are this run's.
            listed = self.folder is not None or (folder / SAVES_FILE).is_file()
        else:
            reserved, listed = reserve_named(folder, names), True
        if listed:
            try:
                record_save(folder, reserved_name(reserved), self.run_name)
            except BaseException:
                reserved.release()
                raise
        return reserved

    def after_load(self, loaded: pathlib.Path) -> None:
        """Continues automatic numbering after the checkpoint just loaded."""
        name = loaded.name
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            self.iteration = max(self.iteration, int(name[len(PREFIX):]) + 1)

    def prune(self) -> None:
        """Deletes this run's oldest checkpoints beyond `total_limit`, by save order.

        This run's are those saves.json says it saved; in a run's own folder, also the numbered
        ones it does not list (an older version's). A folder a link (`last`) leads to is kept.
        """
        if self.total_limit is None:
            return
        root = self.checkpoints_dir
        _remove_stale_deletions(root)
        savers = dict(read_saves(root))

        def own(name: str) -> bool:
            if name in savers:
                return savers[name] == self.run_name
            return self.folder is None and is_numbered(name)

        linked = link_targets(root)
        for old in [path for path in saved_in_order(root) if own(path.name)][:-self.total_limit]:
            if old.name not in linked:
                _delete_checkpoint(old)


def reserve_target(config: ProjectConfiguration, is_main_process: bool,
                   share: Callable[[Any], Any]) -> tuple[pathlib.Path, TempFolder | None]:
    """Reserves the next automatic checkpoint folder on the main process and tells every process.

    Args:
        config: The project's configuration (automatic naming).
        is_main_process: Whether this process reserves the folder.
        share: Returns the main process's value on every process (a broadcast).

    Returns:
        The checkpoint folder, and on the main process the temporary folder it claimed.

    Raises:
        OSError: The reservation failed (a full disk names the folder); on the other processes a
            `CheckpointError` repeats its message, so no process waits for the others in vain.
    """
    reserved, failure = None, None
    if is_main_process:
        try:
            reserved = config.reserve_next_checkpoint()
        except Exception as err:
            failure = err
    config._next_names = None  # consumed on every process, whichever reserved
    try:
        name, message = share((reserved and reserved_name(reserved), failure and str(failure)))
    except BaseException:
        if reserved is not None:
            reserved.release()
        raise
    if failure is not None:
        raise_if_no_space(failure, config.checkpoints_dir)
        raise failure
    if message is not None:
        raise CheckpointError(f"The main process could not reserve the next checkpoint folder under "
                              f"{config.checkpoints_dir}: {message}")
    if is_numbered(name):
        config.iteration = int(name[len(PREFIX):]) + 1
    config.saving = name
    return config.checkpoints_dir / name, reserved


def reserve_named(root: pathlib.Path, names: Iterable[str]) -> TempFolder:
    """Claims the temporary folder `.{name}.tmp` of the first of `names` that is free (main process).

    A name is free when nothing of that name exists in `root` (a folder, a file, a link) and no
    live writer holds its temporary folder: so a save never replaces anything, and two writers
    never pick the same name.

    Raises:
        ValueError: for a name that is not a plain folder name (a separator, '..', hidden).
        FileExistsError: when every candidate is taken.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not is_plain_name(name):
            raise ValueError(f"A checkpoint folder's name must be one plain folder name (no '/', no leading '.', "
                             f"at most 200 bytes). Received: {name!r:.120}.")
        final = root / name
        if os.path.lexists(final):
            continue
        claimed = TempFolder.claim(root / f".{name}.tmp")
        if claimed is not None and not os.path.lexists(final):
            return claimed
        if claimed is not None:  # committed by another writer just before the claim
            claimed.release()
    raise FileExistsError(f"Every candidate name for the next checkpoint under {root} is taken.")


def reserved_name(reserved: TempFolder) -> str:
    """The checkpoint folder name a reservation claimed, from its temporary folder `.{name}.tmp`."""
    return reserved.path.name[1:-len(".tmp")]


_DELETING = ".deleting"


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is an automatic checkpoint folder's name, `checkpoint_{i}` (no path parts)."""
    return re.fullmatch(re.escape(PREFIX) + r"[0-9]+", name) is not None


def delete_checkpoints(root: pathlib.Path, names: Iterable[str]) -> None:
    """Deletes the named checkpoints under `root`, for retention rules other than `total_limit`.

    Each folder is hidden under a temporary name before it is removed, as `prune` does, so a
    crash never leaves a half-deleted checkpoint; a folder already gone is skipped, and so is
    anything that is not a checkpoint: a link, a file, or a folder other than `checkpoint_{i}`
    without a manifest (never a user's). Call it only once the newer checkpoint that replaces
    them is committed.

    Raises:
        ValueError: for a name that is not a plain folder name, which is never deleted.
    """
    _remove_stale_deletions(root)
    for name in names:
        if not is_plain_name(name):
            raise ValueError(f"delete_checkpoints() deletes only checkpoint folders directly under {root}. "
                             f"Received: {name!r:.80}.")
        folder = root / name
        if folder.is_symlink() or not folder.is_dir():
            continue
        if is_checkpoint_name(name) or (folder / MANIFEST_NAME).is_file():
            _delete_checkpoint(folder)


def _remove_stale_deletions(root: pathlib.Path) -> None:
    for stale in root.glob(f".*{_DELETING}"):  # left by a crash during an earlier deletion
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _delete_checkpoint(folder: pathlib.Path) -> None:
    """Removes a checkpoint folder, hiding it under a temporary name first.

    A crash in the middle of deleting then leaves a hidden folder that is never listed, instead
    of a half-deleted `checkpoint_{i}` that would look like a damaged checkpoint.
    """
    hidden = folder.parent / f".{folder.name}{_DELETING}"
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        os.rename(folder, hidden)
    except OSError:
        return  # another process removed it already
    shutil.rmtree(hidden, ignore_errors=True)


def list_checkpoints(
    root: str | os.PathLike[str], prefix: str = "checkpoint_"
) -> list[pathlib.Path]:
    """Lists the folders named ``{prefix}{int}`` directly under `root`, oldest first.

    Temporary folders and other names are ignored. Complete and incomplete folders are both
    listed; use `is_intact` to pick a loadable one.

    Args:
        root: The folder holding the checkpoints.
        prefix: The name before the number.

    Returns:
        The folders, sorted by their number ascending; empty when `root` does not exist.
    """
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)")
    root_path = pathlib.Path(root)
    if not root_path.is_dir():
        return []
    found = []
    for entry in root_path.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not entry.name.startswith(".") and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]
