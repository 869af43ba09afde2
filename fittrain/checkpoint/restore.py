"""load_state's two steps: read and check every file (`read_state`), then apply it (`apply_state`).

`read_state` changes no live object: accelerator_state.json comes first, so another process count
or precision is refused before the large files are read, and every piece is then checked by
`checks` against what will load it. `apply_state` restores the live objects, RNG last. A refused
checkpoint therefore changes nothing. Nothing is ever read by unpickling arbitrary objects.
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Callable, Iterator, Sequence

import torch

from fittrain.checkpoint import checks
from fittrain.checkpoint.errors import CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.reader import CheckpointReader
from fittrain.checkpoint.rng import derive_rank_state, restore_rng_state
from fittrain.checkpoint.sharded import (
    VALUES_NAME,
    ShardCheck,
    check_against,
    merge_values,
    read_index,
    saved_indices,
    split_tensors,
)
from fittrain.checkpoint.snapshot import META_NAME, StateParts, indexed_name
from fittrain.common.nested import map_tensors


def _require(reader: CheckpointReader, name: str, what: str) -> None:
    if not reader.has(name):
        raise CheckpointMismatchError(
            f"Checkpoint {reader.path} has no {name}, but this run has {what}. Prepare the same models, "
            "optimizers and schedulers, in the same order, as the run that saved it."
        )


def _read_rng_states(reader: CheckpointReader, processes: int, rank: int) -> Any:
    """Reads and checks every rank's RNG file (small), returning this rank's state.

    Every rank checks them all, so that every rank finds the same checkpoint damaged or intact
    and, when loading the newest, all of them pass over the same ones. On more processes than
    saved it, a rank the saving run did not have gets states derived from process 0's and its
    rank (`rng.derive_rank_state`); on fewer, the files of the ranks gone are checked, not used.
    """
    states = []
    for i in range(processes):
        name = f"random_states_{i}.pt"
        if not reader.has(name):
            raise CheckpointError(f"Checkpoint {reader.path} has no {name}, but its {META_NAME} says it was "
                                  f"saved by {processes} processes. The checkpoint is damaged; load an earlier one.")
        states.append(reader.read_torch(name))
        checks.check_rng(reader.path / name, states[-1])
        if i != rank and i != 0:
            states[-1] = None  # checked; not needed in memory
    return states[rank] if rank < processes else derive_rank_state(states[0], rank)


def _read_data_states(reader: CheckpointReader, processes: int, rank: int, count: int,
                      live_processes: int | None = None, loaders: Sequence[Any] = ()) -> list[Any]:
    """Reads and checks every rank's data-state file (small), returning this rank's loader states.

    On another number of processes (`live_processes`) every rank continues from process 0's
    loader states, once `checks.check_elastic_data` found that every loader can be dealt again.
    """
    every: list[Any] = []
    for i in range(processes):
        name = f"data_states_{i}.pt"
        if not reader.has(name):
            raise CheckpointError(
                f"Checkpoint {reader.path} has no {name}, which holds where each data loader of process {i} stands; "
                "without it the data cannot continue exactly. Nothing was loaded. The checkpoint is damaged or was not "
                "written by save_state; load another one, or load only its weights with "
                "fittrain.checkpoint.load_model_weights.")
        states = reader.read_torch(name)
        checks.check_data_states(reader.path / name, states, count, loaders)
        every.append(states)
    if live_processes is not None and live_processes != processes:
        checks.check_elastic_data(reader.path, every, live_processes)
        return every[0]
    return every[rank]


def _read_meta(reader: CheckpointReader, live: dict[str, Any]) -> dict[str, Any]:
    """Reads and checks accelerator_state.json first: it says whether this run can resume at all."""
    if not reader.has(META_NAME):
        raise CheckpointError(
            f"Checkpoint {reader.path} has no {META_NAME}, which holds the step counter, the data positions and "
            "the process count; without it a resume cannot continue exactly. Nothing was loaded. Load a "
            "checkpoint that save_state wrote completely.")
    meta = reader.read_json(META_NAME)
    checks.check_meta(reader.path / META_NAME, meta, live)
    return meta


def _file_names(parts: StateParts) -> dict[str, list[str]]:
    return {
        "models": [indexed_name("model", i, "safetensors") for i in range(len(parts.model_state_dicts))],
        "optimizers": [indexed_name("optimizer", i, "pt") for i in range(len(parts.optimizers))],
        "schedulers": [indexed_name("scheduler", i, "pt") for i in range(len(parts.schedulers))],
        "custom": [f"custom_checkpoint_{i}.pt" for i in range(len(parts.custom))],
    }


def _read_shards(reader: CheckpointReader, parts: StateParts, meta: dict[str, Any]) -> Any:
    """Reads a sharded checkpoint's index and checks its model and optimizer counts and types;
    returns the index for `sharded.read_shards`."""
    index = read_index(reader)
    for kind, live in (("model", len(parts.model_state_dicts)), ("optimizer", len(parts.optimizers))):
        saved = saved_indices(index[1], kind)
        if saved != list(range(live)) and not (kind == "model" and saved[:live] == list(range(live))):
            raise CheckpointMismatchError(
                f"Checkpoint {reader.path} holds the shards of {len(saved)} {kind}(s), but this run has {live}. "
                "Prepare the same models and optimizers, in the same order, as the run that saved it.")
    saved_types, live_types = meta.get("optimizer_types"), parts.accelerator_state.get("optimizer_types")
    if isinstance(saved_types, list) and saved_types != live_types:
        raise CheckpointMismatchError(
            f"Checkpoint {reader.path} holds the state of optimizers {saved_types}, but this run has {live_types}. "
            "An optimizer's state loads only into the same kind of optimizer; prepare the ones the run that saved "
            "it had.")
    return index


def read_state(reader: CheckpointReader, parts: StateParts, rank: int,
               share: Callable[[Any], list[Any]] = lambda value: [value],
               live_shards: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Reads and checks every file this process needs, without changing any live object.

    accelerator_state.json comes first (another process count or precision is refused before the
    large files are read). Every piece is then checked against what loads it: optimizers against
    the prepared ones, the RNG state on fresh generators, the data positions' fields, so that
    `apply_state` cannot fail half-way (models: `check_model_states`).

    A sharded checkpoint's shards are checked (metadata, checksums) but read only by `apply_state`:
    DCP reads them straight into the live shards. `share` gathers a value from every process
    (all_gather_object), so that all of them refuse a damaged shard together. `live_shards`
    returns the live models' and optimizers' sharded states (`write_shards`' form), which the
    shards' metadata and values.pt are checked against as strictly as full files (`_check_shards`);
    they are kept for `apply_state` to fill. Describing an optimizer that has no state yet makes
    DCP create it: run the load under `undo_new_optimizer_state`.

    Returns:
        The loaded pieces, to hand to `apply_state` once all of them proved intact.
    """
    meta = _read_meta(reader, parts.accelerator_state)
    names = _file_names(parts)
    shards = check = None
    if meta.get("state_dict_type") == "sharded":
        # Each rank checks its share of the shard files while it reads everything else.
        check = ShardCheck(reader, rank, parts.accelerator_state["num_processes"])
        shards = _read_shards(reader, parts, meta)
        names["models"], names["optimizers"] = [], []
    for kind, files in names.items():
        for name in files:
            _require(reader, name, f"a matching entry among its {kind}")
    loaded = {
        "shards": shards,
        # Left in the files' memory maps: a model's load copies them into its parameters, and
        # `own_optimizer_state` copies an optimizer's into its live state where it has one.
        "models": [reader.read_tensors(n, owned=False) for n in names["models"]],
        "optimizers": [reader.read_torch(n, owned=False) for n in names["optimizers"]],
        "schedulers": [reader.read_torch(n) for n in names["schedulers"]],
        "custom": [reader.read_torch(n) for n in names["custom"]],
        "scaler": reader.read_torch("scaler.pt") if reader.has("scaler.pt") else {},
        "rng": _read_rng_states(reader, meta["num_processes"], rank),
        "data": _read_data_states(reader, meta["num_processes"], rank, len(meta["dataloaders"]),
                                  parts.accelerator_state["num_processes"], parts.dataloaders),
        "meta": meta, "folder": reader.path, "names": names, "rank": rank,
    }
    _check_loaded(reader.path, loaded, parts)
    if check is not None:
        check.wait(share)
    loaded["live_shards"] = live_shards() if shards is not None and live_shards is not None else None
    if loaded["live_shards"] is not None:
        _check_shards(reader.path, loaded, parts)
    return loaded


def _check_shards(folder: pathlib.Path, loaded: dict[str, Any], parts: StateParts) -> None:
    """Checks a sharded checkpoint's values.pt and shards against the live states they will load
    into: each optimizer's entry as the full format checks optimizer.pt (`checks.check_optimizer`),
    its groups' parameter names, the rest of every entry (`checks.check_saved_values`), and every
    live tensor's name, shape and dtype in the metadata (`sharded.check_against`)."""
    (metadata, values), live = loaded["shards"], loaded["live_shards"]
    path, types = folder / VALUES_NAME, loaded["meta"].get("optimizer_types")
    for name, state in live.items():
        saved = values.get(name, {})
        if name.startswith("optimizer_"):
            i = int(name.rpartition("_")[2])
            saved_type = types[i] if isinstance(types, list) and len(types) > i and isinstance(types[i], str) else None
            # What will load: the live tensors with the saved values (an entry without both parts is damaged).
            whole = isinstance(saved, dict) and {"state", "param_groups"} <= saved.keys()
            view = merge_values(state, saved) if whole else saved
            checks.check_optimizer(path, parts.optimizers[i], view, saved_type, entry=name)
            checks.check_group_members(path, name, state["param_groups"], view["param_groups"])
            state, saved, name = state["state"], saved["state"], f"{name}/state"
        checks.check_saved_values(path, name, state, saved)
    tensors: dict[str, Any] = {}
    for name, state in live.items():
        split_tensors(state, name, tensors)
    check_against(folder, metadata, tensors)


@contextlib.contextmanager
def undo_new_optimizer_state(optimizers: Sequence[Any]) -> Iterator[None]:
    """Empties again, if the block raises, the state of the optimizers that had none when it began.

    DCP creates a fresh optimizer's state (a step at lr 0) to describe or load it; a load that is
    refused afterwards must not leave that state behind, or the run's first real step would count
    as its second (AdamW's bias correction, for one).
    """
    fresh = [inner for inner in (getattr(o, "optimizer", o) for o in optimizers) if not inner.state]
    try:
        yield
    except BaseException:
        for inner in fresh:
            inner.state.clear()
        raise


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
                load_optimizer: Callable[[int, dict], None],
                load_shards: Callable[[Any, Any], None] | None = None) -> None:
    """Restores live objects from `read_state`'s result, RNG last so nothing draws after it.

    Schedulers, registered objects and data loaders load first, all or none: their own
    load_state_dict may still refuse a state that `read_state` could not judge, and then the ones
    already loaded get their previous state back and `CheckpointError` names the file, before any
    model, optimizer or RNG is touched. What follows was fully checked by `read_state`. Models and
    optimizers load through callables, which reshard full states under FSDP2; a sharded
    checkpoint's through `load_shards` (given `read_state`'s index and the live sharded states it
    checked; DCP reshards).
    """
    names = loaded["names"]
    # Across process counts every rank continues from process 0's loader states.
    same_count = loaded["meta"]["num_processes"] == parts.accelerator_state["num_processes"]
    data_file = f"data_states_{loaded['rank'] if same_count else 0}.pt"
    checks.load_all_or_none(loaded["folder"], [
        *zip(names["schedulers"], parts.schedulers, loaded["schedulers"]),
        *zip(names["custom"], parts.custom, loaded["custom"]),
        *((data_file, dl, state) for dl, state in zip(parts.dataloaders, loaded["data"]))])
    parts.precision.load_state_dict(loaded["scaler"])
    if loaded["shards"] is not None and load_shards is not None:
        load_shards(loaded["shards"], loaded["live_shards"])
    for i, state_dict in enumerate(loaded["models"]):
        load_model(i, state_dict)
    for i, state in enumerate(loaded["optimizers"]):
        load_optimizer(i, own_optimizer_state(parts.optimizers[i], state))
    restore_rng_state(loaded["rng"])


def own_optimizer_state(optimizer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved`, an optimizer state dict whose tensors are still in the file's memory map, with every
    tensor in memory of its own, so that no live optimizer keeps a checkpoint file mapped.

    A tensor is copied into the live optimizer's state tensor of the same parameter (by index) and
    key where that one is a plain CPU tensor of the same shape and dtype, as on a reload in the same
    process: no new memory is allocated and touched. Any other tensor is cloned.
    """
    live = getattr(optimizer, "optimizer", optimizer).state_dict()["state"]  # the live tensors, not copies
    reused: set[int] = set()
    for index, entry in (saved.get("state") or {}).items():
        current = live.get(index) if type(index) is int else None
        if not (isinstance(entry, dict) and isinstance(current, dict)):
            continue
        for key, value in entry.items():
            target = current.get(key)
            if (type(value) is torch.Tensor and type(target) is torch.Tensor and target.device == value.device
                    and target.shape == value.shape and target.dtype == value.dtype):
                entry[key] = target.copy_(value)
                reused.add(id(target))
    return map_tensors(lambda t: t if id(t) in reused else t.clone(), saved)
