"""Checks of a checkpoint's parsed contents against the live run, made before anything is loaded.

`restore.read_state` runs these on every piece it read, so a checkpoint whose contents are
malformed (a `CheckpointError`) or that this run cannot honour (a `CheckpointMismatchError`:
other models, another optimizer type or precision, or another process count with a loader whose
rest cannot be dealt to this run's processes) is refused, naming the file, while every live object
is still untouched. Loading the newest checkpoint passes over a damaged one, but not over a
mismatch, which an older checkpoint would not cure. Each check only reads.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
from typing import Any, Sequence

import torch

from fittrain.checkpoint.errors import CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.rng import check_rng_state
from fittrain.checkpoint.snapshot import POSITION_FIELDS
from fittrain.common.checks import is_int
from fittrain.common.reprs import short_repr
from fittrain.data.position import STATE_KEYS

_NEVER_LOADED = "Nothing was loaded."


def _is_count(value: Any, least: int = 0) -> bool:
    return is_int(value) and value >= least


def _file(path: pathlib.Path, entry: str | None) -> str:
    """The file for a message, and the entry of it at fault (a sharded checkpoint's values.pt holds several)."""
    return f"{str(path)!r}" + (f" (entry {entry!r})" if entry else "")


def _refuse(path: pathlib.Path, problem: str, fix: str, entry: str | None = None) -> CheckpointError:
    return CheckpointError(f"Checkpoint file {_file(path, entry)} {problem}. {_NEVER_LOADED} {fix}")


def _mismatch(path: pathlib.Path, problem: str, fix: str, entry: str | None = None) -> CheckpointMismatchError:
    return CheckpointMismatchError(f"Checkpoint file {_file(path, entry)} {problem}. {_NEVER_LOADED} {fix}")


def check_meta_fields(path: pathlib.Path, meta: Any) -> None:
    """Checks that accelerator_state.json has every field, of the right type (a damaged one does not).

    Raises:
        CheckpointError: naming the file and the first missing or mistyped field.
    """
    damaged = "Load an earlier checkpoint; this one is damaged or was not written by save_state."
    if not isinstance(meta, dict):
        raise _refuse(path, f"must hold a JSON object. Received: {type(meta).__name__}", damaged)
    fields = (("step", lambda v: _is_count(v)), ("num_processes", lambda v: _is_count(v, 1)),
              ("mixed_precision", lambda v: isinstance(v, str)), ("dataloaders", lambda v: isinstance(v, list)))
    for key, is_valid in fields:
        if not is_valid(meta.get(key)):
            raise _refuse(path, f"has no valid {key!r}. Received: {key}={short_repr(meta.get(key))}", damaged)
    for i, position in enumerate(meta["dataloaders"]):
        _check_position(path, i, position, POSITION_FIELDS, damaged)


def check_meta(path: pathlib.Path, meta: Any, live: dict[str, Any]) -> None:
    """Checks accelerator_state.json's fields, and that this run can honour it.

    Another process count is allowed (an elastic resume) unless a data loader's position says it
    cannot be dealt again (`order_consumed` null: a stream under way); the per-process data states
    are judged later (`check_elastic_data`).

    Args:
        path: The file, for messages.
        meta: Its decoded contents.
        live: This run's `num_processes` and `mixed_precision`.

    Raises:
        CheckpointError: for a missing or mistyped field.
        CheckpointMismatchError: for another precision, or another process count with a loader
            that cannot continue on it.
    """
    check_meta_fields(path, meta)
    saved_n, live_n = meta["num_processes"], live["num_processes"]
    for i, position in enumerate(meta["dataloaders"] if saved_n != live_n else ()):
        if position["order_consumed"] is None:
            raise _mismatch(path, f"was saved by {saved_n} processes, but this run has {live_n}, and its data loader "
                            f"{i} {_STREAM_UNDER_WAY.format(**position)}", _stream_fix(saved_n))
    saved_mp, live_mp = meta["mixed_precision"], live["mixed_precision"]
    if saved_mp != live_mp:
        raise _mismatch(path, f"was saved with mixed_precision={saved_mp!r}, but this run uses "
                        f"mixed_precision={live_mp!r}", f"Resume with mixed_precision={saved_mp!r}.")


#: The least value of each int field (the seed: any int, which a user's sampler may draw).
_LEAST = {"seed": None, "num_processes": 1}
_STREAM_UNDER_WAY = ("reads a stream (a DataLoader over an IterableDataset) {batches_consumed} batches into epoch "
                     "{epoch}: each process read its own share of that pass, which cannot be dealt to another "
                     "number of processes")


def _stream_fix(saved_n: int) -> str:
    return (f"Resume with {saved_n} processes, or from a checkpoint saved between two passes over the stream "
            "(after the loop over it ended, before the next one starts).")


def _check_position(path: pathlib.Path, index: int, position: Any, fields: Sequence[str], damaged: str) -> None:
    """Checks one data loader's saved position: each of `fields` is there, an int of at least 0
    (the seed any int, `num_processes` at least 1), but `order_consumed` may be None (a stream under way)."""
    for name in fields:
        value = position.get(name) if isinstance(position, dict) else None
        least = _LEAST.get(name, 0)
        valid = is_int(value) and (least is None or value >= least)
        if not (valid or (name == "order_consumed" and isinstance(position, dict) and name in position
                          and value is None)):
            raise _refuse(path, f"has no valid {name!r} in the position of data loader {index}. "
                          f"Received: {short_repr(position)}", damaged)


def check_data_states(path: pathlib.Path, states: Any, count: int, loaders: Sequence[Any] = ()) -> None:
    """Checks a rank's data-state file: one dict per loader, each with a valid position that the
    prepared loader it will load into can take (`PositionedSource.check_position`: not past the
    end of its epoch).

    Raises:
        CheckpointError: naming the file, the loader and the field (damage: "latest" passes over it).
    """
    damaged = "Load an earlier checkpoint; this one is damaged or was not written by save_state."
    if not (isinstance(states, list) and len(states) == count):
        raise _refuse(path, f"must hold a list of {count} data loader states (as many as accelerator_state.json "
                      f"lists). Received: {short_repr(states)}", damaged)
    for i, state in enumerate(states):
        _check_position(path, i, state, STATE_KEYS, damaged)
    for i, (state, loader) in enumerate(zip(states, loaders)):
        check = getattr(loader, "check_position", None)
        try:
            if check is not None:
                check(state)
        except ValueError as err:
            raise _refuse(path, f"holds a position that data loader {i} cannot take: {str(err).rstrip('.')}",
                          damaged) from None


def check_elastic_data(folder: pathlib.Path, states: Sequence[list[dict[str, Any]]], live_n: int) -> None:
    """Checks that every loader of a checkpoint saved by `len(states)` processes can continue on `live_n`.

    Each loader's rest of the epoch is dealt again from the count of its order that all processes
    consumed (`order_consumed`), taken from process 0's state: every process must have recorded
    the same epoch and count (a loop whose processes did not run in step cannot be re-dealt), and
    none may be a stream under way (null count).

    Args:
        folder: The checkpoint folder, for messages.
        states: Every saved process's data states (already checked by `check_data_states`).
        live_n: This run's number of processes.

    Raises:
        CheckpointMismatchError: naming the loader, the file, the counts and what to do.
    """
    saved_n = len(states)
    counts = f"was saved by {saved_n} processes, but this run has {live_n}"
    for i, first in enumerate(states[0]):
        for rank, rank_states in enumerate(states):
            state, path = rank_states[i], folder / f"data_states_{rank}.pt"
            if state["order_consumed"] is None:
                raise _mismatch(path, f"{counts}, and its data loader {i} {_STREAM_UNDER_WAY.format(**state)}",
                                _stream_fix(saved_n))
            if (state["epoch"], state["order_consumed"]) != (first["epoch"], first["order_consumed"]):
                raise _mismatch(path, f"{counts}, and its processes disagree on how far data loader {i} got (process "
                                f"0: epoch {first['epoch']}, {first['order_consumed']} consumed; process {rank}: "
                                f"epoch {state['epoch']}, {state['order_consumed']}): its processes did not run in "
                                "step, so the rest of the epoch cannot be dealt again exactly",
                                f"Resume with {saved_n} processes.")


def check_dict(path: pathlib.Path, state: Any, what: str) -> None:
    """Checks that a saved state is a dict, as an LR scheduler's load_state_dict expects.

    Registered objects are not held to this: their state may be anything their own
    load_state_dict accepts, and `load_all_or_none` undoes a load that one of them refuses.
    """
    if not isinstance(state, dict):
        raise _refuse(path, f"must hold the state dict of {what}. Received: {type(state).__name__}",
                      "Load a checkpoint saved by the same code.")


def check_rng(path: pathlib.Path, state: Any) -> None:
    """Checks an RNG file's contents without changing any generator."""
    try:
        check_rng_state(state)
    except ValueError as err:
        raise _refuse(path, f"holds an RNG state that cannot be restored: {err}",
                      "Load an earlier checkpoint; this one is damaged.") from None


def check_scaler(path: pathlib.Path, state: Any, live: dict[str, Any]) -> None:
    """Checks the fp16 GradScaler's saved state against the live scaler's (`live`, empty when off)."""
    if not live:
        return  # no scaler in this run: its load_state_dict ignores the state
    bad = [k for k in live if not (isinstance(state, dict) and isinstance(state.get(k), (int, float))
                                   and not isinstance(state.get(k), bool))]
    if bad:
        raise _refuse(path, f"has no valid loss-scaler state (missing or not numbers: {bad})",
                      "Load an earlier checkpoint; this one is damaged.")


def check_optimizer(path: pathlib.Path, live: Any, saved: Any, saved_type: str | None,
                    entry: str | None = None) -> None:
    """Refuses an optimizer state that the prepared optimizer could not continue from.

    Compares the optimizer class (when the checkpoint records it), the parameter groups' sizes,
    the hyperparameters the live groups need and their kinds (a number, a flag, a tuple of
    numbers), and the per-parameter state's keys (when the live optimizer has state). Torch would
    otherwise load another optimizer's state and fail at the next step, such as with KeyError
    'betas' for an SGD state loaded into Adam, or TypeError for lr='evil'. Both checkpoint formats
    use it: optimizer.pt, and each optimizer's entry of a sharded checkpoint's values.pt (`entry`).

    Raises:
        CheckpointError: naming the file, when it holds no optimizer state dict, or one whose
            values are not of the kinds the optimizer uses (damage).
        CheckpointMismatchError: naming the file and the difference.
    """
    fix = "Prepare the same optimizers, over the same parameters, as the run that saved it."
    damaged = "Load an earlier checkpoint; this one is damaged."
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                             for g in groups) and isinstance(saved.get("state"), dict)
            and all(isinstance(s, dict) for s in saved["state"].values())):
        raise _refuse(path, "does not hold an optimizer state dict (with 'state' and 'param_groups')", damaged, entry)
    if not groups:
        raise _refuse(path, "holds an optimizer state without parameter groups (every optimizer has one at least)",
                      damaged, entry)
    live_type = type(getattr(live, "optimizer", live)).__name__
    if saved_type is not None and saved_type != live_type:
        raise _mismatch(path, f"holds the state of an optimizer of type {saved_type}, but the prepared "
                        f"optimizer is of type {live_type}", fix, entry)
    live_sizes, saved_sizes = [len(g["params"]) for g in live.param_groups], [len(g["params"]) for g in groups]
    if saved_sizes != live_sizes:
        raise _mismatch(path, f"holds an optimizer with parameter groups of sizes {saved_sizes}, but the "
                        f"prepared optimizer has {live_sizes}", fix, entry)
    for i, (live_group, saved_group) in enumerate(zip(live.param_groups, groups)):
        # Flags (bools, None) missing from an older torch's state are filled in by load_state_dict.
        missing = sorted(k for k, v in live_group.items()
                         if k not in saved_group and v is not None and not isinstance(v, bool))
        if missing:
            raise _mismatch(path, f"holds parameter group {i} without the hyperparameters {missing} that "
                            f"the prepared {live_type} needs: it was saved from another optimizer type", fix, entry)
        for key, value in live_group.items():
            if key != "params" and key in saved_group and not _same_kind(value, saved_group[key]):
                raise _refuse(path, f"holds parameter group {i} with {key}={short_repr(saved_group[key])}, where the "
                              f"prepared {live_type} has {_kind(value)}", damaged, entry)
    _check_state_keys(path, live, saved["state"], live_type, fix, entry)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.dtype.is_complex and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_kind(live: Any, saved: Any) -> bool:
    """Whether a saved value can stand where the live run has `live`: a number for a number, a flag
    for a flag, a sequence of as many for a tuple (values.pt keeps tuples as lists), a string for
    a string. None in the live run is a setting torch fills in as it likes (foreach, fused)."""
    if live is None:
        return True
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if _is_number(live):
        return _is_number(saved)
    if isinstance(live, (list, tuple)):
        return (isinstance(saved, (list, tuple)) and len(saved) == len(live)
                and all(_same_kind(a, b) for a, b in zip(live, saved)))
    if isinstance(live, str):
        return isinstance(saved, str)
    return True


def _kind(live: Any) -> str:
    """What `_same_kind` accepts in place of `live`, for messages."""
    if isinstance(live, bool):
        return f"a flag ({live})"
    if _is_number(live):
        return f"a number ({short_repr(live)})"
    if isinstance(live, (list, tuple)):
        return f"a sequence of {len(live)} ({short_repr(live)})"
    return f"a {type(live).__name__} ({short_repr(live)})"


def _check_state_keys(path: pathlib.Path, live: Any, saved_state: dict[Any, dict], live_type: str,
                      fix: str, entry: str | None) -> None:
    """Compares the keys of the per-parameter state, when both the saved and live optimizers have some."""
    saved_keys = set().union(*(s.keys() for s in saved_state.values()))
    live_keys = set().union(*(s.keys() for s in live.state.values() if isinstance(s, dict)))
    if saved_keys and live_keys and saved_keys != live_keys:
        raise _mismatch(path, f"holds per-parameter optimizer state with keys {sorted(map(str, saved_keys))}, "
                        f"but the prepared {live_type} keeps {sorted(map(str, live_keys))}", fix, entry)


def check_group_members(path: pathlib.Path, entry: str, live_groups: list[dict], saved_groups: list[dict]) -> None:
    """Refuses parameter groups, keyed by parameter name (a sharded checkpoint), over other parameters
    than the live groups of the same sizes: their hyperparameters would load onto the wrong ones.

    Raises:
        CheckpointMismatchError: naming the file, the group and a parameter that moved.
    """
    for i, (live_group, saved_group) in enumerate(zip(live_groups, saved_groups)):
        moved = sorted(set(map(str, saved_group["params"])) ^ set(map(str, live_group["params"])))
        if moved:
            raise _mismatch(path, f"holds parameter group {i} over other parameters than the prepared optimizer's "
                            f"group {i} (e.g. {short_repr(moved[0])} is in one of them only)",
                            "Prepare the same optimizers, with the same parameter groups, as the run that saved it.",
                            entry)


def check_saved_values(path: pathlib.Path, entry: str, live: Any, saved: Any) -> None:
    """Refuses a sharded checkpoint's values.pt entry that does not fit the live state it will be
    merged into (`sharded.merge_values`): containers of another kind or length, names the run does
    not have, a value where the run holds a tensor (the tensors come from the shards), or a value
    of another kind (`_same_kind`).

    Raises:
        CheckpointError: naming the file and the path of the first misfit (damage).
    """
    pending = [(entry, live, saved)]
    while pending:
        where, live_value, saved_value = pending.pop()
        if isinstance(live_value, torch.Tensor):
            problem = None if saved_value is None else "a value where the shards hold a tensor"
        elif isinstance(live_value, dict):
            unknown = [k for k in saved_value if k not in live_value] if isinstance(saved_value, dict) else []
            problem = "not a dict" if not isinstance(saved_value, dict) else None
            if unknown:  # named by its path, not by the whole dict around it
                where, saved_value = f"{where}/{unknown[0]}", saved_value[unknown[0]]
                problem = "a name this run does not have"
            elif problem is None:
                pending.extend((f"{where}/{k}", live_value[k], v) for k, v in saved_value.items())
        elif isinstance(live_value, (list, tuple)):
            fits = isinstance(saved_value, (list, tuple)) and len(saved_value) == len(live_value)
            problem = None if fits else f"not a list of {len(live_value)}"
            if fits:
                pending.extend((f"{where}/{k}", a, b) for k, (a, b) in enumerate(zip(live_value, saved_value)))
        else:
            problem = None if _same_kind(live_value, saved_value) else f"not {_kind(live_value)}"
        if problem:
            raise _refuse(path, f"holds at {where!r} {short_repr(saved_value)}: {problem}",
                          "Load an earlier checkpoint; this one is damaged.")


def check_model_states(folder: pathlib.Path, loaded: Sequence[dict[str, torch.Tensor]],
                       live: Sequence[dict[str, torch.Tensor]]) -> None:
    """Refuses saved weights whose keys or shapes differ from the live models', before any is applied.

    Raises:
        CheckpointMismatchError: naming the file and the first mismatching keys.
    """
    for i, (saved, current) in enumerate(zip(loaded, live)):
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        reshaped = sorted(k for k in set(saved) & set(current) if tuple(saved[k].shape) != tuple(current[k].shape))
        problems = [f"{label}: {keys[:5]}" for label, keys in (
            ("missing keys", missing), ("unexpected keys", unexpected), ("different shapes", reshaped)) if keys]
        if problems:
            raise CheckpointMismatchError(
                f"Checkpoint file {folder / (f'model_{i}' if i else 'model')}.safetensors does not fit model {i} "
                f"({'; '.join(problems)}). Nothing was loaded. Load a checkpoint saved from the same architecture.")


def load_all_or_none(folder: pathlib.Path, pieces: list[tuple[str, Any, Any]]) -> None:
    """Loads each (file name, object, state); if one fails, restores the ones loaded and raises.

    Raises:
        CheckpointMismatchError: naming the file whose state its object refused.
    """
    previous = [_own_copy(obj.state_dict()) for _, obj, _ in pieces]
    for done, (name, obj, state) in enumerate(pieces):
        try:
            obj.load_state_dict(state)
        except Exception as err:
            for (_, touched, _), old in zip(pieces[:done + 1], previous):
                # Best effort: its own state_dict() loads back; failing here must not hide `err`.
                with contextlib.suppress(Exception):
                    touched.load_state_dict(old)
            detail = (str(err).splitlines() or [""])[0][:200]
            raise CheckpointMismatchError(
                f"Checkpoint file {str(folder / name)!r} was refused by {type(obj).__name__}.load_state_dict "
                f"({type(err).__name__}: {detail}). Nothing was loaded. Load a checkpoint saved by the same "
                "code, with the same callbacks and registered objects.") from err


def _own_copy(state: Any) -> Any:
    """A deep copy of a state_dict, which may share containers with its object (that a load mutates)."""
    try:
        return copy.deepcopy(state)
    except Exception:  # not copyable: the state as returned is the best there is to restore
        return state
