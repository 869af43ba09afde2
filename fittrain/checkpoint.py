"""save_state/load_state: what goes into a checkpoint folder, and the project's naming scheme.

Layout of one folder (written atomically through `storage.atomic_checkpoint`):

    model.safetensors, model_1.safetensors, ...   unwrapped weights; load with safetensors alone
    optimizer.pt, optimizer_1.pt, ...            optimizer state_dicts (weights_only)
    scheduler.pt, ...                             LR scheduler state_dicts (weights_only)
    scaler.pt                                     fp16 GradScaler state, when fp16 is on
    random_states_{rank}.pt                       Python/NumPy/torch/CUDA RNG, one file per rank
    custom_checkpoint_{i}.pt                      objects given to register_for_checkpointing
    accelerator_state.json                        step counter, data positions, world size
    manifest.json                                 every file's size and crc32, written last

A save first captures the state into a `StateSnapshot` of plain data (`capture_state`), then
writes it (`write_checkpoint`); with copies in the snapshot, the writing can run on a background
thread (`fittrain.async_checkpoint`). Nothing here is ever read by unpickling arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from typing import Any, Callable, Sequence

import torch

from . import checkpoint_checks as checks
from .checkpoint_checks import check_model_states  # noqa: F401  (load_state calls it from here)
from .rng import capture_rng_state, restore_rng_state
from .storage import (CheckpointDeletedError, CheckpointError, CheckpointReader, CheckpointWriter,
                      atomic_checkpoint, list_checkpoints)
from .temp_folders import TempFolder, raise_if_no_space, reserve_numbered

CHECKPOINTS_DIR = "checkpoints"
PREFIX = "checkpoint_"


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project keeps its checkpoints and logs, and how checkpoints are named.

    With `automatic_checkpoint_naming`, `save_state()` writes
    `{project_dir}/checkpoints/checkpoint_{iteration}`, keeps at most `total_limit` of them, and
    `load_state()` loads the newest complete one.

    Args:
        project_dir: Root folder of the project; defaults to the working directory.
        logging_dir: Where loggers write; defaults to `{project_dir}/logs`.
        automatic_checkpoint_naming: Name checkpoint folders automatically.
        total_limit: Keep at most this many automatic checkpoints (oldest are deleted).
        iteration: Number of the next automatic checkpoint.
        save_on_each_node: Accepted for Accelerate compatibility; fittrain writes shared files once.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.total_limit is not None and (not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ValueError(
                f"`total_limit` must be a positive int or None. Received: total_limit={self.total_limit!r}."
            )
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            # A negative number names a folder (`checkpoint_-3`) that "latest" never finds.
            raise ValueError(
                "`ProjectConfiguration(iteration=...)` must be an int >= 0, the number of the next "
                f"automatic checkpoint. Received: iteration={self.iteration!r:.80}. Pass 0 to start "
                "from checkpoint_0 (existing checkpoints are never overwritten)."
            )
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Sets `project_dir` and derives `logging_dir` from it when none was given."""
        self.project_dir = os.fspath(project_dir) if project_dir is not None else None
        if self.logging_dir is None and self.project_dir is not None:
            self.logging_dir = os.path.join(self.project_dir, "logs")

    @property
    def checkpoints_dir(self) -> pathlib.Path:
        """The folder that holds automatically named checkpoints."""
        return pathlib.Path(self.project_dir or ".") / CHECKPOINTS_DIR

    def next_checkpoint_dir(self) -> pathlib.Path:
        """The folder for the next automatic save; never one that already exists."""
        existing = [int(p.name[len(PREFIX):]) for p in list_checkpoints(self.checkpoints_dir, PREFIX)]
        self.iteration = max([self.iteration, *(i + 1 for i in existing)])
        return self.checkpoints_dir / f"{PREFIX}{self.iteration}"

    def reserve_next_checkpoint(self) -> TempFolder:
        """Claims the temporary folder of the next automatic checkpoint (on the main process).

        The number is the first from `next_checkpoint_dir()`'s on that neither names a folder nor
        is being written by another live writer (another job, another Accelerator), so writers
        sharing the project never pick the same number. `iteration` moves past it.

        Returns:
            The claimed folder; its `number` names the checkpoint. Commit it with `write_checkpoint`,
            or `release()` it.
        """
        self.next_checkpoint_dir()  # moves `iteration` past the existing folders
        reserved = reserve_numbered(self.checkpoints_dir, PREFIX, self.iteration)
        self.iteration = reserved.number + 1
        return reserved

    def after_load(self, loaded: pathlib.Path) -> None:
        """Continues automatic numbering after the checkpoint just loaded."""
        name = loaded.name
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            self.iteration = max(self.iteration, int(name[len(PREFIX):]) + 1)

    def prune(self) -> None:
        """Deletes the oldest automatic checkpoints beyond `total_limit`."""
        if self.total_limit is None:
            return
        root = self.checkpoints_dir
        for stale in root.glob(f".{PREFIX}*{_DELETING}"):  # left by a crash during an earlier prune
            shutil.rmtree(stale, ignore_errors=True)
        for old in list_checkpoints(root, PREFIX)[:-self.total_limit]:
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
    try:
        number, message = share((reserved and reserved.number, failure and str(failure)))
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
    config.iteration = number + 1
    return config.checkpoints_dir / f"{PREFIX}{number}", reserved


_DELETING = ".deleting"


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


def latest_checkpoint(root: pathlib.Path, warn: Callable[[str], None],
                      damaged: set[pathlib.Path] | None = None) -> pathlib.Path:
    """The newest intact `checkpoint_{i}` under `root`, warning about damaged newer ones.

    Every file of a candidate is checked against its manifest (size and CRC32); the warning for a
    folder passed over names the file that failed. A folder that vanishes while it is checked was
    pruned by a run still saving, which commits a newer one first: the listing is read again,
    without a warning.

    Args:
        root: The folder holding the checkpoints.
        warn: Called with the warning for each damaged folder passed over.
        damaged: Folders already known to be damaged, passed over without a look; the damaged
            folders found are added to it.

    Raises:
        FileNotFoundError: when `root` holds no intact checkpoint.
    """
    damaged = set() if damaged is None else damaged
    for _ in range(_LISTINGS):
        found, vanished = _newest_intact(list_checkpoints(root, PREFIX), warn, damaged)
        if found is not None or not vanished:
            break
    if found is None:
        raise FileNotFoundError(f"No complete checkpoint found under {root}. Save one with save_state() first.")
    return found


def load_newest(root: pathlib.Path, warn: Callable[[str], None], load: Callable[[pathlib.Path], Any]) -> Any:
    """Loads the newest loadable checkpoint under `root` with `load`, and returns what it returns.

    A folder whose files prove damaged only when `load` reads them (their checksums match, but a
    file is refused, such as a planted pickle) is passed over with a warning, like one that fails
    its checksums; one pruned meanwhile is passed over silently. `load` changes nothing when it
    raises, so the next older folder can be tried.

    Raises:
        FileNotFoundError: when no loadable checkpoint is left.
        CheckpointMismatchError: when the newest intact checkpoint does not fit this run (an older
            one would not either).
    """
    damaged: set[pathlib.Path] = set()
    pruned = 0
    while True:  # each turn adds a folder to `damaged` or counts a pruned one: it ends
        folder = latest_checkpoint(root, warn, damaged)
        try:
            return load(folder)
        except checks.CheckpointMismatchError:
            raise
        except (CheckpointDeletedError, FileNotFoundError):
            pruned += 1  # pruned after it was chosen: a newer one exists, so choose again
            if pruned >= _LISTINGS:
                raise
        except CheckpointError as err:
            damaged.add(folder)
            warn(f"Skipping checkpoint {folder}: it is damaged, so an older one is used. Detail: {err}")


# How often `latest_checkpoint` lists the folder again after a candidate vanished under it.
_LISTINGS = 20
_META = "accelerator_state.json"


def _verify(reader: CheckpointReader) -> None:
    """Checks every file's checksum, and that accelerator_state.json is there and well formed.

    That file is small and parsed here too, so a garbled one (with a matching checksum) counts as
    damage, which "latest" skips, rather than failing the load that would follow.
    """
    reader.verify()
    if not reader.has(_META):
        raise CheckpointError(f"Checkpoint {reader.path} is incomplete: it has no {_META}.")
    checks.check_meta_fields(reader.path / _META, reader.read_json(_META))


def _newest_intact(folders: list[pathlib.Path], warn: Callable[[str], None],
                   damaged: set[pathlib.Path]) -> tuple[pathlib.Path | None, bool]:
    """The newest intact folder of `folders` (or None), and whether one vanished while checked.

    Folders in `damaged` are skipped; newly found damaged ones are added and warned about once.
    """
    for folder in reversed(folders):
        if folder in damaged:
            continue
        try:
            _verify(CheckpointReader(folder))
            return folder, False
        except CheckpointDeletedError:
            return None, True
        except FileNotFoundError:
            return None, True  # renamed away between the listing and the first look
        except (CheckpointError, OSError) as err:
            damaged.add(folder)
            warn(f"Skipping checkpoint {folder}: it is incomplete or damaged, so an older one is used. "
                 f"Detail: {err}")
    return None, False


def _indexed(base: str, i: int, ext: str) -> str:
    return f"{base}{'' if i == 0 else f'_{i}'}.{ext}"


@dataclasses.dataclass
class StateParts:
    """The live objects whose state one checkpoint captures.

    Attributes:
        model_state_dicts: Full state dicts of the unwrapped models (gathered under FSDP2).
        optimizer_state_dicts: Full optimizer state dicts (gathered under FSDP2).
        optimizers, schedulers, dataloaders, custom: Objects with state_dict/load_state_dict.
        precision: The precision object (its scaler state is saved when fp16 is on).
        accelerator_state: Small JSON-safe facts, such as the accumulation step counter.
    """

    model_state_dicts: list[dict[str, torch.Tensor]]
    optimizer_state_dicts: list[dict[str, Any]]
    optimizers: Sequence[Any]
    schedulers: Sequence[Any]
    dataloaders: Sequence[Any]
    custom: Sequence[Any]
    precision: Any
    accelerator_state: dict[str, Any]


@dataclasses.dataclass
class StateSnapshot:
    """What one process writes into one checkpoint, captured as plain data.

    Capturing and writing are separate steps so that the writing can happen on a background
    thread while training goes on: the writer only ever reads this object, never a live one.
    Off the main process only the RNG states are captured, since only they are written there.

    Attributes:
        rank: The process's rank; it names the RNG file.
        is_main_process: Whether this process writes the shared files.
        rng: This process's RNG states, as `capture_rng_state` returns them.
        models, optimizers, schedulers, custom: State dicts, one per file, in file order.
        scaler: The fp16 GradScaler's state; empty without one (no file is written then).
        meta: The contents of accelerator_state.json, data positions included.
    """

    rank: int
    is_main_process: bool
    rng: dict[str, Any]
    models: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    custom: list[Any] = dataclasses.field(default_factory=list)
    scaler: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def capture_state(parts: StateParts, rank: int, is_main_process: bool,
                  stage: Callable[[Any], Any] | None = None) -> StateSnapshot:
    """Reads every piece of state one checkpoint holds, RNG first, into a `StateSnapshot`.

    Args:
        parts: The live objects (with the model and optimizer state dicts already gathered).
        rank: This process's rank.
        is_main_process: Whether this process writes the shared files.
        stage: Copies a state (a tree of containers and tensors) into memory of its own on the
            CPU, so that training may keep mutating the live tensors in place while the snapshot
            is written (`async_checkpoint.StagingBuffers.copy`). Without it the snapshot shares
            the live tensors (no copy, no extra memory) and must be written before training continues.

    Returns:
        The snapshot, ready for `write_snapshot`.
    """
    rng = capture_rng_state()  # fresh tensors: never shared with the live generators
    if not is_main_process:
        return StateSnapshot(rank, False, rng)
    own = stage or _same
    meta = dict(parts.accelerator_state, dataloaders=[dl.state_dict() for dl in parts.dataloaders])
    return StateSnapshot(
        rank, True, rng,
        models=[own(state_dict) for state_dict in parts.model_state_dicts],
        optimizers=[own(state) for state in parts.optimizer_state_dicts],
        schedulers=[own(sched.state_dict()) for sched in parts.schedulers],
        custom=[own(obj.state_dict()) for obj in parts.custom],
        scaler=own(parts.precision.state_dict()), meta=own(meta))


def _same(obj: Any) -> Any:
    return obj


def write_snapshot(writer: CheckpointWriter, snapshot: StateSnapshot) -> None:
    """Writes every file of one checkpoint from a snapshot; shared files from the main process only."""
    writer.write_torch(f"random_states_{snapshot.rank}.pt", snapshot.rng)
    if not snapshot.is_main_process:
        return
    for i, state_dict in enumerate(snapshot.models):
        writer.write_tensors(_indexed("model", i, "safetensors"), state_dict, {"format": "pt"})
    for i, state in enumerate(snapshot.optimizers):
        writer.write_torch(_indexed("optimizer", i, "pt"), state)
    for i, state in enumerate(snapshot.schedulers):
        writer.write_torch(_indexed("scheduler", i, "pt"), state)
    for i, state in enumerate(snapshot.custom):
        writer.write_torch(f"custom_checkpoint_{i}.pt", state)
    if snapshot.scaler:
        writer.write_torch("scaler.pt", snapshot.scaler)
    writer.write_json("accelerator_state.json", snapshot.meta)


def write_checkpoint(folder: pathlib.Path, snapshot: StateSnapshot, barrier: Callable[[], None],
                     after_commit: Callable[[], None] | None = None, reserved: TempFolder | None = None) -> None:
    """Writes a snapshot as a complete checkpoint folder (atomically), then runs `after_commit`.

    Every process calls it with the same `folder`; `barrier` synchronises them (on the thread
    this runs on). `after_commit`, such as pruning old checkpoints, runs only once the folder is
    in place, so a failed save never deletes an older checkpoint. `reserved` is the main process's
    claim from `ProjectConfiguration.reserve_next_checkpoint` (automatic naming): the folder is
    then committed without ever replacing one. Without it an existing `folder` is replaced.
    """
    with atomic_checkpoint(folder, is_main_process=snapshot.is_main_process, barrier=barrier,
                           reserved=reserved) as writer:
        write_snapshot(writer, snapshot)
    if after_commit is not None:
        after_commit()


def _require(reader: CheckpointReader, name: str, what: str) -> None:
    if not reader.has(name):
        raise checks.CheckpointMismatchError(
            f"Checkpoint {reader.path} has no {name}, but this run has {what}. Prepare the same models, "
            "optimizers and schedulers, in the same order, as the run that saved it."
        )


def _read_rng_states(reader: CheckpointReader, processes: int, rank: int) -> Any:
    """Reads and checks every rank's RNG file (small), returning this rank's state.

    Every rank checks them all, so that every rank finds the same checkpoint damaged or intact
    and, when loading the newest, all of them pass over the same ones.
    """
    mine = None
    for i in range(processes):
        name = f"random_states_{i}.pt"
        if not reader.has(name):
            raise CheckpointError(f"Checkpoint {reader.path} has no {name}, but its {_META} says it was saved by "
                                  f"{processes} processes. The checkpoint is damaged; load an earlier one.")
        state = reader.read_torch(name)
        checks.check_rng(reader.path / name, state)
        mine = state if i == rank else mine
    return mine


def _read_meta(reader: CheckpointReader, live: dict[str, Any]) -> dict[str, Any]:
    """Reads and checks accelerator_state.json first: it says whether this run can resume at all."""
    if not reader.has(_META):
        raise CheckpointError(
            f"Checkpoint {reader.path} has no {_META}, which holds the step counter, the data positions and "
            "the process count; without it a resume cannot continue exactly. Nothing was loaded. Load a "
            "checkpoint that save_state wrote completely.")
    meta = reader.read_json(_META)
    checks.check_meta(reader.path / _META, meta, live)
    return meta


def _file_names(parts: StateParts) -> dict[str, list[str]]:
    return {
        "models": [_indexed("model", i, "safetensors") for i in range(len(parts.model_state_dicts))],
        "optimizers": [_indexed("optimizer", i, "pt") for i in range(len(parts.optimizers))],
        "schedulers": [_indexed("scheduler", i, "pt") for i in range(len(parts.schedulers))],
        "custom": [f"custom_checkpoint_{i}.pt" for i in range(len(parts.custom))],
    }


def read_state(reader: CheckpointReader, parts: StateParts, rank: int) -> dict[str, Any]:
    """Reads and checks every file this process needs, without changing any live object.

    accelerator_state.json comes first (another process count or precision is refused before the
    large files are read). Every piece is then checked against what loads it: optimizers against
    the prepared ones, the RNG state on fresh generators, the data positions' fields, so that
    `apply_state` cannot fail half-way (models: `check_model_states`).

    Returns:
        The loaded pieces, to hand to `apply_state` once all of them proved intact.
    """
    meta = _read_meta(reader, parts.accelerator_state)
    names = _file_names(parts)
    for kind, files in names.items():
        for name in files:
            _require(reader, name, f"a matching entry among its {kind}")
    loaded = {
        "models": [reader.read_tensors(n) for n in names["models"]],
        "optimizers": [reader.read_torch(n) for n in names["optimizers"]],
        "schedulers": [reader.read_torch(n) for n in names["schedulers"]],
        "custom": [reader.read_torch(n) for n in names["custom"]],
        "scaler": reader.read_torch("scaler.pt") if reader.has("scaler.pt") else {},
        "rng": _read_rng_states(reader, meta["num_processes"], rank),
        "meta": meta, "folder": reader.path, "names": names,
    }
    _check_loaded(reader.path, loaded, parts)
    return loaded


def _check_loaded(folder: pathlib.Path, loaded: dict[str, Any], parts: StateParts) -> None:
    names, n = loaded["names"], len(parts.optimizers)
    types = loaded["meta"].get("optimizer_types")  # absent from checkpoints of older versions
    if not (isinstance(types, list) and len(types) == n):
        types = [None] * n
    for name, live, saved, saved_type in zip(names["optimizers"], parts.optimizers, loaded["optimizers"], types):
        checks.check_optimizer(folder / name, live, saved, saved_type if isinstance(saved_type, str) else None)
    for name, state in zip(names["schedulers"], loaded["schedulers"]):
        checks.check_dict(folder / name, state, "an LR scheduler")
    if loaded["scaler"]:
        checks.check_scaler(folder / "scaler.pt", loaded["scaler"], parts.precision.state_dict())


def apply_state(loaded: dict[str, Any], parts: StateParts, load_model: Callable[[int, dict], None],
                load_optimizer: Callable[[int, dict], None]) -> None:
    """Restores live objects from `read_state`'s result, RNG last so nothing draws after it.

    Schedulers and registered objects load first, all or none: their own load_state_dict may still
    refuse a state that `read_state` could not judge, and then the ones already loaded get their
    previous state back and `CheckpointError` names the file, before any model, optimizer or RNG
    is touched. What follows was fully checked by `read_state`. Models and optimizers load through
    callables, which reshard full states under FSDP2.
    """
    names = loaded["names"]
    checks.load_all_or_none(loaded["folder"], [
        *zip(names["schedulers"], parts.schedulers, loaded["schedulers"]),
        *zip(names["custom"], parts.custom, loaded["custom"])])
    parts.precision.load_state_dict(loaded["scaler"])
    for i, state_dict in enumerate(loaded["models"]):
        load_model(i, state_dict)
    for i, state in enumerate(loaded["optimizers"]):
        load_optimizer(i, state)
    for dl, state in zip(parts.dataloaders, loaded["meta"]["dataloaders"]):
        dl.load_state_dict(state)
    restore_rng_state(loaded["rng"])
