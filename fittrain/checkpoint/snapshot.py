"""What goes into a checkpoint folder: live objects captured as a `StateSnapshot`, then written.

Layout of one folder (written atomically through `folder.atomic_checkpoint`):

    model.safetensors, model_1.safetensors, ...   unwrapped weights; load with safetensors alone
    optimizer.pt, optimizer_1.pt, ...            optimizer state_dicts (weights_only)
    scheduler.pt, ...                             LR scheduler state_dicts (weights_only)
    scaler.pt                                     fp16 GradScaler state, when fp16 is on
    random_states_{rank}.pt                       Python/NumPy/torch/CUDA RNG, one file per rank
    data_states_{rank}.pt                         each prepared loader's state on that rank (stream
                                                  positions, dataset and sampler states), weights_only
    custom_checkpoint_{i}.pt                      objects given to register_for_checkpointing
    shards/                                       instead of model and optimizer files, with
                                                  state_dict_type="sharded": each rank's shards (`sharded`)
    accelerator_state.json                        step counter, data positions, world size
    manifest.json                                 every file's size and crc32, written last

A save first captures the state into a `StateSnapshot` of plain data (`capture_state`), then
writes it (`write_checkpoint`); with copies in the snapshot, the writing can run on a background
thread (`background`). `restore` reads it back.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import shutil
from typing import Any, Callable, Sequence

import torch

from fittrain.checkpoint.errors import CheckpointError
from fittrain.checkpoint.fastio import MANIFEST_NAME, CheckpointWriter
from fittrain.checkpoint.folder import WRITER_MARKER, atomic_checkpoint
from fittrain.checkpoint.rng import capture_rng_state
from fittrain.checkpoint.sharded import SHARDS_DIR, write_shards
from fittrain.checkpoint.temp_folders import TempFolder

# The step counter, data positions and process count; read first on load: it says whether a run can resume.
META_NAME = "accelerator_state.json"
# The fields of each loader's position that accelerator_state.json lists (readable without torch).
POSITION_FIELDS = ("seed", "epoch", "batches_consumed", "order_consumed")


def indexed_name(base: str, i: int, ext: str) -> str:
    """The name of the `i`-th file of a kind: `model.safetensors`, `model_1.safetensors`, ..."""
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
        sharded: For a sharded checkpoint, every rank's own shards of the models and optimizers,
            keyed "model_{i}" and "optimizer_{i}" (`sharded.write_shards`); the two lists of full
            state dicts are then empty. None for a full checkpoint.
    """

    model_state_dicts: list[dict[str, torch.Tensor]]
    optimizer_state_dicts: list[dict[str, Any]]
    optimizers: Sequence[Any]
    schedulers: Sequence[Any]
    dataloaders: Sequence[Any]
    custom: Sequence[Any]
    precision: Any
    accelerator_state: dict[str, Any]
    sharded: dict[str, Any] | None = None


@dataclasses.dataclass
class StateSnapshot:
    """What one process writes into one checkpoint, captured as plain data.

    Capturing and writing are separate steps so that the writing can happen on a background
    thread while training goes on: the writer only ever reads this object, never a live one.
    Off the main process only the RNG and data states are captured, since only they are written there.

    Attributes:
        rank: The process's rank; it names the RNG and data-state files.
        is_main_process: Whether this process writes the shared files.
        rng: This process's RNG states, as `capture_rng_state` returns them.
        data: Each prepared loader's `state_dict()` on this process (a stream's position and its
            dataset's state differ between ranks).
        models, optimizers, schedulers, custom: State dicts, one per file, in file order.
        scaler: The fp16 GradScaler's state; empty without one (no file is written then).
        meta: The contents of accelerator_state.json, data positions included.
        sharded: This rank's shards of the models and optimizers (every rank writes its own), or None.
    """

    rank: int
    is_main_process: bool
    rng: dict[str, Any]
    data: list[Any] = dataclasses.field(default_factory=list)
    models: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    schedulers: list[Any] = dataclasses.field(default_factory=list)
    custom: list[Any] = dataclasses.field(default_factory=list)
    scaler: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    sharded: dict[str, Any] | None = None
    #: Makes the copies a staged capture deferred (`background.StagingBuffers.fill`); the writing
    #: thread calls it before it writes anything. None when every tensor was copied at the call.
    fill: Callable[[], None] | None = None


def capture_state(parts: StateParts, rank: int, is_main_process: bool,
                  stage: Callable[..., Any] | None = None,
                  stable: Callable[[torch.Tensor], bool] | None = None) -> StateSnapshot:
    """Reads every piece of state one checkpoint holds, RNG first, into a `StateSnapshot`.

    Args:
        parts: The live objects (with the model and optimizer state dicts already gathered).
        rank: This process's rank.
        is_main_process: Whether this process writes the shared files.
        stage: Copies a state (a tree of containers and tensors) into memory of its own on the
            CPU, so that training may keep mutating the live tensors in place while the snapshot
            is written (`background.StagingBuffers.copy`). Without it the snapshot shares
            the live tensors (no copy, no extra memory) and must be written before training continues.
        stable: With `stage`: whether a model tensor changes only in optimizer steps (a parameter,
            not a buffer that forward passes update). Those, and every optimizer's per-parameter
            state, are staged later, on the writing thread (`stage(obj, later)`).

    Returns:
        The snapshot, ready for `write_snapshot`.
    """
    rng = capture_rng_state()  # fresh tensors: never shared with the live generators
    # Loader states are small and may share containers with live iterators: always copy them.
    data = [copy.deepcopy(dl.state_dict()) for dl in parts.dataloaders]
    own = stage or _same
    if stage is not None and stable is not None:
        def own_model(state: Any) -> Any:
            return stage(state, stable)

        def own_optimizer(state: Any) -> Any:  # its "state" changes only in steps; the groups, with a scheduler
            if not isinstance(state, dict):
                return stage(state)
            return {key: stage(value, _always) if key == "state" else stage(value) for key, value in state.items()}
    else:
        own_model = own_optimizer = own
    sharded = None if parts.sharded is None else {
        name: (own_optimizer if name.startswith("optimizer_") else own_model)(value)
        for name, value in parts.sharded.items()}
    if not is_main_process:
        return StateSnapshot(rank, False, rng, data, sharded=sharded)
    # The main process's positions, readable without torch (the full states are in data_states_*).
    positions = [{key: state[key] for key in POSITION_FIELDS} for state in data]
    meta = dict(parts.accelerator_state, dataloaders=positions)
    return StateSnapshot(
        rank, True, rng, data,
        models=[own_model(state_dict) for state_dict in parts.model_state_dicts],
        optimizers=[own_optimizer(state) for state in parts.optimizer_state_dicts],
        schedulers=[own(sched.state_dict()) for sched in parts.schedulers],
        custom=[own(obj.state_dict()) for obj in parts.custom],
        scaler=own(parts.precision.state_dict()), meta=own(meta), sharded=sharded)


def _same(obj: Any) -> Any:
    return obj


def _always(tensor: torch.Tensor) -> bool:
    return True


def write_snapshot(writer: CheckpointWriter, snapshot: StateSnapshot) -> None:
    """Writes every file of one checkpoint from a snapshot, but its shards (written by every rank
    together in `write_checkpoint`); shared files from the main process only."""
    writer.write_torch(f"random_states_{snapshot.rank}.pt", snapshot.rng)
    writer.write_torch(f"data_states_{snapshot.rank}.pt", snapshot.data)
    if not snapshot.is_main_process:
        return
    for i, state_dict in enumerate(snapshot.models):
        writer.write_tensors(indexed_name("model", i, "safetensors"), state_dict, {"format": "pt"})
    for i, state in enumerate(snapshot.optimizers):
        writer.write_torch(indexed_name("optimizer", i, "pt"), state)
    for i, state in enumerate(snapshot.schedulers):
        writer.write_torch(indexed_name("scheduler", i, "pt"), state)
    for i, state in enumerate(snapshot.custom):
        writer.write_torch(f"custom_checkpoint_{i}.pt", state)
    if snapshot.scaler:
        writer.write_torch("scaler.pt", snapshot.scaler)
    writer.write_json(META_NAME, snapshot.meta)


def write_checkpoint(folder: pathlib.Path, snapshot: StateSnapshot, barrier: Callable[[], None],
                     after_commit: Callable[[], None] | None = None, reserved: TempFolder | None = None,
                     hook_files: pathlib.Path | None = None, group: Any = None) -> None:
    """Writes a snapshot as a complete checkpoint folder (atomically), then runs `after_commit`.

    Every process calls it with the same `folder`; `barrier` synchronises them (on the thread
    this runs on). `after_commit`, such as pruning old checkpoints, runs only once the folder is
    in place, so a failed save never deletes an older checkpoint. `reserved` is the main process's
    claim from `ProjectConfiguration.reserve_next_checkpoint` (automatic naming): the folder is
    then committed without ever replacing one. Without it an existing `folder` is replaced.
    `hook_files`, on the main process, is a folder whose files (those save_state's pre-hooks
    wrote) become part of the checkpoint, committed and checksummed with it. `group` is the
    process group a sharded write synchronises on (the barrier's; None: the default group).
    """
    with atomic_checkpoint(folder, is_main_process=snapshot.is_main_process, barrier=barrier,
                           reserved=reserved) as writer:
        if snapshot.fill is not None:  # inside: a fill that fails leaves nothing, as a failed write
            snapshot.fill()
        write_snapshot(writer, snapshot)
        if snapshot.sharded is not None:  # a collective: every rank writes its shards, DCP synchronises them
            write_shards(writer.path, snapshot.sharded, snapshot.is_main_process, writer, group)
        if hook_files is not None and snapshot.is_main_process:
            copy_hook_files(hook_files, writer.path)
    if after_commit is not None:
        after_commit()



def copy_hook_files(source: pathlib.Path, folder: pathlib.Path) -> None:
    """Copies what save_state's pre-hooks wrote into the checkpoint folder being written, durably.

    Raises:
        CheckpointError: for a name the checkpoint itself uses (the hook would be overwritten, or
            overwrite a checkpoint file), or for something that is not a file or folder.
    """
    for entry in sorted(source.rglob("*")):
        relative = entry.relative_to(source)
        top = relative.parts[0]
        clashes = (top in (MANIFEST_NAME, WRITER_MARKER, SHARDS_DIR)
                   or top.startswith(("random_states_", "data_states_"))
                   or (len(relative.parts) == 1 and (folder / top).exists()))
        if clashes:
            raise CheckpointError(
                f"A save_state pre-hook wrote {relative.as_posix()!r}, a name the checkpoint itself uses. Write the "
                "hook's files under names of their own, e.g. a subfolder such as output_dir/'unet'.")
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            raise CheckpointError(f"A save_state pre-hook left {relative.as_posix()!r}, which is neither a file nor "
                                  "a folder. A checkpoint holds plain files only.")
        target = folder / relative
        if entry.is_dir():
            target.mkdir(exist_ok=True)
            continue
        shutil.copyfile(entry, target)
        with open(target, "rb") as copied:  # durable before the manifest is written and the folder renamed
            os.fsync(copied.fileno())
    for directory in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
