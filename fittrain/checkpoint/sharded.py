"""Sharded model and optimizer state: each rank writes its own shards with torch.distributed.checkpoint.

A sharded checkpoint keeps the models and optimizers in one subfolder instead of
`model.safetensors` and `optimizer.pt`:

    shards/__{rank}_0.distcp    the tensors each rank holds (its FSDP2 shards; a replicated tensor
                                is written once, by one rank) as raw bytes, written in parallel
    shards/metadata.json        where every chunk of every tensor lies (`dcp_io`; never pickled)
    shards/values.pt            the rest of each state (an optimizer's param_groups), weights_only;
                                checked against the live states before anything loads, as
                                strictly as a full checkpoint's optimizer.pt (`restore._check_shards`)

No rank gathers the full state: each writes its shard, so memory grows with the shard, not the
model. Loading reshards: every rank reads the chunks that overlap what it holds now, on any
number of processes. The files are covered by the checkpoint's manifest like any other; each rank
checks the checksums of a share of them before DCP reads (`ShardCheck`).

The state of a model is keyed `model_{i}/{name}`, of an optimizer `optimizer_{i}/{path}`, paths
joined with "/" (parameter names contain dots).
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fittrain.checkpoint.errors import CheckpointDeletedError, CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.renames import fsync_dir

# torch.distributed.checkpoint (`dcp_io`) is imported when a sharded checkpoint is written or
# read: it takes half a second to import, which every other run would pay at `import fittrain`.
SHARDS_DIR = "shards"
VALUES_NAME = f"{SHARDS_DIR}/values.pt"
METADATA_PATH = f"{SHARDS_DIR}/metadata.json"


def split_tensors(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Moves every tensor of `tree` into `tensors` (keyed by path); returns the rest of the tree.

    Dict entries holding a tensor are left out of the rest; list items become None.
    """
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree
        return None
    if isinstance(tree, dict):
        rest = {}
        for key, value in tree.items():
            kept = split_tensors(value, f"{prefix}/{key}", tensors)
            if not isinstance(value, torch.Tensor):
                rest[key] = kept
        return rest
    if isinstance(tree, (list, tuple)):
        return [split_tensors(value, f"{prefix}/{i}", tensors) for i, value in enumerate(tree)]
    return tree


def merge_values(tensors_tree: Any, values: Any) -> Any:
    """`tensors_tree` (a live state, its tensors loaded) with every non-tensor value from `values`."""
    if isinstance(values, dict) and isinstance(tensors_tree, dict):
        merged = dict(tensors_tree)
        for key, value in values.items():
            merged[key] = merge_values(tensors_tree.get(key), value)
        return merged
    if isinstance(values, list) and isinstance(tensors_tree, (list, tuple)) and len(values) == len(tensors_tree):
        return [merge_values(t, v) for t, v in zip(tensors_tree, values)]
    if values is None and isinstance(tensors_tree, torch.Tensor):
        return tensors_tree
    return values


@contextlib.contextmanager
def _one_process_is_fine(alone: bool | None = None) -> Iterator[None]:
    """Silences DCP's warning that it runs without a process group: here that is the intent."""
    if not (not dist.is_initialized() if alone is None else alone):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _first_failure() -> Iterator[None]:
    """Raises the first failing rank's own exception, on every rank, instead of DCP's summary.

    DCP gathers every rank's exception into one `CheckpointException`, a BaseException (so
    `except Exception` misses it) whose message is a stack dump. Unwrapped, a full disk stays an
    OSError naming its file and a damaged shard a CheckpointError naming it, as with full checkpoints.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # DCP: only sharded checkpoints pay for it

    try:
        yield
    except CheckpointException as err:
        first = err.failures[min(err.failures)][0] if err.failures else None
        if isinstance(first, Exception):
            raise first from None
        raise


def write_shards(folder: pathlib.Path, states: dict[str, Any], is_main_process: bool, writer: Any,
                 group: Any = None) -> None:
    """Every rank writes its shards of `states` into `folder/shards` (collective).

    Each rank then checksums the files it wrote, and the main process lists them all in the
    manifest from those sums: no rank reads another's shards.

    Args:
        folder: The checkpoint folder being written (its temporary path).
        states: {"model_0": state dict, "optimizer_0": optimizer state dict, ...}, sharded
            (DTensors under FSDP2) or replicated (plain tensors).
        is_main_process: Whether this rank writes `values.pt` (the same on every rank).
        writer: The checkpoint's `CheckpointWriter` (values.pt; the records of every rank's files).
        group: The process group DCP synchronises on (None: the default group).
    """
    # torch.distributed.checkpoint (and dcp_io, built on it) is slow to import: only sharded checkpoints need it.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from fittrain.checkpoint.dcp_io import RawWriter

    tensors: dict[str, torch.Tensor] = {}
    values = {name: split_tensors(state, name, tensors) for name, state in states.items()}
    (folder / SHARDS_DIR).mkdir(exist_ok=True)
    storage = RawWriter(folder / SHARDS_DIR)
    with _first_failure(), _one_process_is_fine():
        dcp.save(tensors, storage_writer=storage, planner=DefaultSavePlanner(), process_group=group,
                 no_dist=not dist.is_initialized())
    fsync_dir(folder / SHARDS_DIR)  # the writer fsyncs its file, not the folder's entry for it
    own = {f"{SHARDS_DIR}/{name}": size_crc for name, size_crc in storage.written.items()}
    everyone = [own]
    if dist.is_initialized():
        everyone = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(everyone, own, group=group)
    if is_main_process:
        for records in everyone:
            for name, (size, crc) in records.items():
                writer.record(name, size, crc)
        writer.write_torch(VALUES_NAME, values)


def read_index(reader: Any) -> tuple[Any, dict[str, Any]]:
    """Parses shards/metadata.json and reads values.pt (both verified against the manifest first).

    Returns:
        DCP's metadata, and the non-tensor values of every saved state, keyed by state name.
    """
    from fittrain.checkpoint.dcp_io import metadata_from_json  # imports DCP: only sharded checkpoints pay for it

    data = reader.read_json(METADATA_PATH)
    try:
        metadata = metadata_from_json(data)
    except ValueError as err:
        raise CheckpointError(f"Checkpoint file {reader.path / METADATA_PATH} is damaged: {err}. Nothing was "
                              "loaded; load another checkpoint.") from None
    for index, info in metadata.storage_data.items():
        size = reader.size(f"{SHARDS_DIR}/{info.relative_path}")
        if size is None or info.offset + info.length > size:
            raise CheckpointError(
                f"Checkpoint file {reader.path / METADATA_PATH} is damaged: it places {index.fqn!r} at bytes "
                f"{info.offset} to {info.offset + info.length} of {info.relative_path}, which the manifest "
                f"{'does not list' if size is None else f'lists as {size} bytes'}. Nothing was loaded; load another "
                "checkpoint.")
    values = reader.read_torch(VALUES_NAME)
    if not (isinstance(values, dict) and all(isinstance(key, str) for key in values)):
        raise CheckpointError(f"Checkpoint file {reader.path / VALUES_NAME} is damaged: it is not a dict of states "
                              "keyed by name. Nothing was loaded; load another checkpoint.")
    return metadata, values


def saved_indices(values: dict[str, Any], kind: str) -> list[int]:
    """The indices i of the "{kind}_{i}" states a sharded checkpoint holds, sorted."""
    found = []
    for name in values:
        prefix, _, number = name.rpartition("_")
        if prefix == kind and number.isdigit():
            found.append(int(number))
    return sorted(found)


def check_against(folder: pathlib.Path, metadata: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Refuses a checkpoint whose shards do not hold every live tensor, with the same size and dtype."""
    saved = metadata.state_dict_metadata
    for key, tensor in tensors.items():
        entry = saved.get(key)
        if entry is None:
            raise CheckpointMismatchError(
                f"Checkpoint {folder} has no {key!r} in its shards, but this run has it. Prepare the same models and "
                "optimizers, in the same order, as the run that saved it. Nothing was loaded.")
        if tuple(entry.size) != tuple(tensor.shape) or entry.properties.dtype != tensor.dtype:
            raise CheckpointMismatchError(
                f"Checkpoint {folder} holds {key!r} as {entry.properties.dtype} of shape {tuple(entry.size)}, but this "
                f"run has {tensor.dtype} of shape {tuple(tensor.shape)}. Load it into the model it was saved from. "
                "Nothing was loaded.")
    names = {key.split("/", 1)[0] for key in tensors}
    extra = sorted(key for key in saved if key.split("/", 1)[0] in names and key not in tensors)
    if extra:
        raise CheckpointMismatchError(
            f"Checkpoint {folder} holds {len(extra)} tensors this run does not have, e.g. {extra[0]!r}. Prepare the "
            "same models and optimizers as the run that saved it. Nothing was loaded.")


def shard_files(reader: Any) -> list[str]:
    """The checkpoint's shard files (those DCP reads), in manifest order."""
    return [name for name in reader.names() if name.startswith(f"{SHARDS_DIR}/") and name.endswith(".distcp")]


class ShardCheck:
    """Checks the checksums of this rank's share of the shard files on a thread, while the rest of
    the checkpoint is read; `wait` ends the check on every rank together.

    zlib releases the GIL while it checksums, so where a core is free the check hides behind the
    other reads. No tensor is read before `wait` returns: a damaged shard changes nothing.

    Every shard file is opened first and held by the reader (`CheckpointReader.hold`) until the
    load ends: the shards are read into the live model after the other files were applied, and a
    folder pruned in between must not leave a load half done. Held, the verified files stay
    readable whole; a folder pruned before they were verified is refused as deleted.

    Args:
        reader: The checkpoint's reader (closed by its owner when the load ends).
        rank, world: This process and the number of processes (rank r checks files r, r + world, ...).
    """

    def __init__(self, reader: Any, rank: int, world: int) -> None:
        self._reader, self._names = reader, shard_files(reader)[rank::world]
        self._problem: tuple[str, str] | None = None
        self._thread: threading.Thread | None = None
        try:
            reader.hold(shard_files(reader))
        except CheckpointError as err:  # raised on every rank together, by `wait`
            self._problem = (type(err).__name__, str(err))
            return
        self._thread = threading.Thread(target=self._run, name="fittrain-shard-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._reader.verify(self._names)
        except CheckpointError as err:
            self._problem = (type(err).__name__, str(err))
        except Exception as err:  # noqa: BLE001 - reported on every rank by `wait`, never lost on the thread
            self._problem = (CheckpointError.__name__, f"Checking the shard files of {self._reader.path} failed: "
                             f"{type(err).__name__}: {err}. Nothing was loaded.")

    def wait(self, share: Callable[[Any], list[Any]]) -> None:
        """Waits for this rank's check and raises the first problem any rank found, on every rank.

        Args:
            share: Gathers one value from every rank to every rank (all_gather_object).

        Raises:
            CheckpointError: naming the first damaged shard file (CheckpointDeletedError when the
                folder was pruned meanwhile, so that `load_newest` moves on).
        """
        if self._thread is not None:
            self._thread.join()
        found = [p for p in share(self._problem) if p is not None]
        if found:
            kind, message = found[0]
            raise (CheckpointDeletedError if kind == CheckpointDeletedError.__name__ else CheckpointError)(message)


def read_shards(reader: Any, states: dict[str, Any], index: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
    """Loads the saved tensors into the live `states`' tensors (collective), then their saved values.

    Args:
        reader: The checkpoint's reader (shard files already verified).
        states: Live states keyed as in `write_shards`; their tensors (local shards) are filled in place.
        index: `read_index`'s result.

    Returns:
        The states with the saved non-tensor values (e.g. param_groups) merged in, to load.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, state in states.items():
        split_tensors(state, name, tensors)
    metadata, values = index
    check_against(reader.path, metadata, tensors)
    read_tensors(reader, tensors, metadata, collective=True)
    return {name: merge_values(state, values.get(name, {})) for name, state in states.items()}



def read_tensors(reader: Any, tensors: dict[str, torch.Tensor], metadata: Any, collective: bool = False) -> None:
    """Fills `tensors` (keyed by saved name; DTensors: their local shards) in place from the shard
    files, reading only the chunks that overlap them.

    Args:
        collective: Every process of the default group calls this together (needed for DTensors);
            otherwise this process reads on its own, whatever the others do.
    """
    # torch.distributed.checkpoint (and dcp_io, built on it) is slow to import: only sharded checkpoints need it.
    import torch.distributed.checkpoint as dcp

    from fittrain.checkpoint.dcp_io import RawReader, TensorsOnlyLoadPlanner

    no_dist = not (collective and dist.is_initialized())
    prefix = f"{SHARDS_DIR}/"
    held = {name[len(prefix):]: file for name, file in reader.held.items() if name.startswith(prefix)}
    with _first_failure(), _one_process_is_fine(no_dist):
        dcp.load(tensors, storage_reader=RawReader(reader.path / SHARDS_DIR, metadata, held),
                 planner=TensorsOnlyLoadPlanner(), no_dist=no_dist)


def whole_model(reader: Any, index: tuple[Any, dict[str, Any]], model: int = 0) -> dict[str, torch.Tensor]:
    """Model `model`'s whole weights, assembled on the CPU from every rank's shards by this process
    alone (shard files verified first). Memory: the whole model; `fittrain consolidate` streams."""
    metadata, values = index
    if model not in saved_indices(values, "model"):
        raise CheckpointError(f"Checkpoint {reader.path} has no model {model}; it holds models "
                              f"{saved_indices(values, 'model')}.")
    reader.verify(shard_files(reader))
    prefix = f"model_{model}/"
    tensors = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}
    read_tensors(reader, tensors, metadata)
    return {key[len(prefix):]: tensor for key, tensor in tensors.items()}
