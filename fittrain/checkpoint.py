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

from .rng import capture_rng_state, restore_rng_state
from .storage import CheckpointError, CheckpointReader, CheckpointWriter, atomic_checkpoint, list_checkpoints

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


def latest_checkpoint(root: pathlib.Path, warn: Callable[[str], None]) -> pathlib.Path:
    """The newest intact `checkpoint_{i}` under `root`, warning about damaged newer ones.

    Every file of a candidate is checked against its manifest (size and CRC32); the warning for a
    folder passed over names the file that failed.

    Raises:
        FileNotFoundError: when `root` holds no intact checkpoint.
    """
    for folder in reversed(list_checkpoints(root, PREFIX)):
        try:
            CheckpointReader(folder).verify()
            return folder
        except (CheckpointError, OSError) as err:
            warn(f"Skipping checkpoint {folder}: it is incomplete or damaged, so an older one is used. "
                 f"Detail: {err}")
    raise FileNotFoundError(f"No complete checkpoint found under {root}. Save one with save_state() first.")


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
                     after_commit: Callable[[], None] | None = None) -> None:
    """Writes a snapshot as a complete checkpoint folder (atomically), then runs `after_commit`.

    Every process calls it with the same `folder`; `barrier` synchronises them (on the thread
    this runs on). `after_commit`, such as pruning old checkpoints, runs only once the folder is
    in place, so a failed save never deletes an older checkpoint.
    """
    with atomic_checkpoint(folder, is_main_process=snapshot.is_main_process, barrier=barrier) as writer:
        write_snapshot(writer, snapshot)
    if after_commit is not None:
        after_commit()


def _require(reader: CheckpointReader, name: str, what: str) -> None:
    if not reader.has(name):
        raise CheckpointError(
            f"Checkpoint {reader.path} has no {name}, but this run has {what}. Prepare the same models, "
            "optimizers and schedulers, in the same order, as the run that saved it."
        )


def _check_optimizer_fits(path: pathlib.Path, live: Any, saved: Any) -> None:
    """Raises before anything is loaded when the saved optimizer has other parameter groups."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    live_sizes = [len(g["params"]) for g in live.param_groups]
    saved_sizes = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
    if saved_sizes != live_sizes:
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} holds an optimizer with parameter groups of sizes {saved_sizes}, "
            f"but the prepared optimizer has {live_sizes}. Nothing was loaded. Prepare the same optimizers, "
            "over the same parameters, as the run that saved it.")


def read_state(reader: CheckpointReader, parts: StateParts, rank: int) -> dict[str, Any]:
    """Reads and verifies every file this process needs, without changing any live object.

    Every optimizer is checked against its file, so a checkpoint with other parameter groups fails
    here instead of half-way through `apply_state` (models: `check_model_states`).

    Returns:
        The loaded pieces, to hand to `apply_state` once all of them proved intact.
    """
    names = {
        "models": [_indexed("model", i, "safetensors") for i in range(len(parts.model_state_dicts))],
        "optimizers": [_indexed("optimizer", i, "pt") for i in range(len(parts.optimizers))],
        "schedulers": [_indexed("scheduler", i, "pt") for i in range(len(parts.schedulers))],
        "custom": [f"custom_checkpoint_{i}.pt" for i in range(len(parts.custom))],
    }
    for kind, files in names.items():
        for name in files:
            _require(reader, name, f"a matching entry among its {kind}")
    rng_name = f"random_states_{rank}.pt"
    _require(reader, rng_name, f"a process of rank {rank}")
    loaded = {
        "models": [reader.read_tensors(n) for n in names["models"]],
        "optimizers": [reader.read_torch(n) for n in names["optimizers"]],
        "schedulers": [reader.read_torch(n) for n in names["schedulers"]],
        "custom": [reader.read_torch(n) for n in names["custom"]],
        "scaler": reader.read_torch("scaler.pt") if reader.has("scaler.pt") else {},
        "rng": reader.read_torch(rng_name),
        "meta": reader.read_json("accelerator_state.json") if reader.has("accelerator_state.json") else {},
    }
    for name, live, saved in zip(names["optimizers"], parts.optimizers, loaded["optimizers"]):
        _check_optimizer_fits(reader.path / name, live, saved)
    return loaded


def check_model_states(folder: pathlib.Path, loaded: Sequence[dict[str, torch.Tensor]],
                       live: Sequence[dict[str, torch.Tensor]]) -> None:
    """Refuses saved weights whose keys or shapes differ from the live models', before any is applied.

    Raises:
        CheckpointError: naming the file and the first mismatching keys.
    """
    for i, (saved, current) in enumerate(zip(loaded, live)):
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        reshaped = sorted(k for k in set(saved) & set(current) if tuple(saved[k].shape) != tuple(current[k].shape))
        problems = [f"{label}: {keys[:5]}" for label, keys in (
            ("missing keys", missing), ("unexpected keys", unexpected), ("different shapes", reshaped)) if keys]
        if problems:
            raise CheckpointError(
                f"Checkpoint file {folder / _indexed('model', i, 'safetensors')} does not fit model {i} "
                f"({'; '.join(problems)}). Nothing was loaded. Load a checkpoint saved from the same architecture.")


def apply_state(loaded: dict[str, Any], parts: StateParts, load_model: Callable[[int, dict], None],
                load_optimizer: Callable[[int, dict], None]) -> None:
    """Restores live objects from `read_state`'s result, RNG last so nothing draws after it.

    Models and optimizers load through callables, which reshard full states under FSDP2.
    """
    for i, state_dict in enumerate(loaded["models"]):
        load_model(i, state_dict)
    for i, state in enumerate(loaded["optimizers"]):
        load_optimizer(i, state)
    for obj, state in zip(parts.schedulers, loaded["schedulers"]):
        obj.load_state_dict(state)
    for obj, state in zip(parts.custom, loaded["custom"]):
        obj.load_state_dict(state)
    parts.precision.load_state_dict(loaded["scaler"])
    for dl, state in zip(parts.dataloaders, loaded["meta"].get("dataloaders", [])):
        dl.load_state_dict(state)
    restore_rng_state(loaded["rng"])
