"""Collectives over nested structures of tensors, with one process as the trivial case.

Every function takes the `ProcessState` of its Accelerator; with one process they return their
input (or a copy) without touching torch.distributed.

Shapes that differ between processes make a reduction or broadcast fail deep inside the backend
(gloo aborts the process). In Accelerate's debug mode (ACCELERATE_DEBUG_MODE, `PartialState().debug
= True`, `fittrain launch --debug`) `reduce` and `broadcast` first compare the shapes every process
passes, one small gather, and raise `DistributedOperationException` naming them.
`pad_across_processes` always compares them (it gathers the sizes anyway).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fittrain.common.checks import check_choice
from fittrain.common.nested import map_tensors
from fittrain.distributed.process_state import ProcessState


class DistributedOperationException(Exception):
    """A collective cannot run: the processes passed tensors of different shapes (Accelerate's name)."""


def _debug() -> bool:
    return os.environ.get("ACCELERATE_DEBUG_MODE", "").strip().lower() in ("1", "true", "yes")


def _shapes(obj: Any) -> Any:
    """The nested structure of `obj` with each tensor replaced by its shape, for comparing across processes."""
    if isinstance(obj, torch.Tensor):
        return tuple(obj.shape)
    if isinstance(obj, dict):
        return {k: _shapes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_shapes(v) for v in obj]
    return type(obj).__name__


def _verify_same_shapes(operation: str, data: Any, state: ProcessState) -> None:
    """In debug mode, raises DistributedOperationException unless every process passes the same shapes."""
    if not _debug():
        return
    shapes = gather_object(_shapes(data), state)
    if any(shape != shapes[0] for shape in shapes):
        listed = "\n  - ".join(f"Process {rank}: {shape}" for rank, shape in enumerate(shapes))
        raise DistributedOperationException(
            f"Cannot apply {operation}: the processes passed tensors of different shapes, and every process must "
            f"pass the same.\n\nOperation: `{operation}`\nInput shapes:\n  - {listed}")


def _map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Applies `fn` to each tensor inside dicts, lists, tuples and namedtuples; refuses other leaves."""
    return map_tensors(fn, obj, other=_refuse_leaf)


def _refuse_leaf(obj: Any) -> Any:
    raise TypeError(
        f"Collectives take tensors or dicts/lists/tuples of tensors. Received an object of type "
        f"{type(obj).__name__}; convert it to a tensor, or use gather_object for Python objects."
    )


def gather_object(obj: Any, state: ProcessState) -> list[Any]:
    """Returns the list of `obj` from every process, in rank order.

    Args:
        obj: Any picklable object.
        state: The calling Accelerator's process state.
    """
    if not state.is_distributed:
        return [obj]
    out: list[Any] = [None] * state.num_processes
    dist.all_gather_object(out, obj)
    return out


def _check_gatherable(shapes: list[tuple[int, ...]], dtypes: list[str]) -> None:
    """Raises on every rank alike (they all see the same lists), so no rank is left waiting."""
    if len({s[1:] for s in shapes}) > 1:
        listing = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
        raise ValueError(
            f"gather() needs tensors whose shapes match beyond the first dimension. Received {listing}. "
            "Pad them first with pad_across_processes()."
        )
    if len(set(dtypes)) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise ValueError(
            f"gather() needs the same dtype on every process. Received {listing}. "
            "Cast them to one dtype first, e.g. tensor.float()."
        )


def _gather_one(tensor: torch.Tensor, state: ProcessState) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.ndim == 0:
        tensor = tensor[None]
    # One small object gather first: a mismatch then fails with a clear error on every rank
    # instead of a tensor all_gather that deadlocks or mixes up bytes.
    meta = gather_object((tuple(tensor.shape), str(tensor.dtype)), state)
    shapes, dtypes = [m[0] for m in meta], [m[1] for m in meta]
    _check_gatherable(shapes, dtypes)
    longest = max(s[0] for s in shapes)
    if longest == 0:
        return tensor  # Nothing anywhere: skip a zero-byte all_gather, which some backends reject.
    padded = tensor
    if tensor.shape[0] < longest:
        filler = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, filler])
    # gloo has no bool all_gather; uint8 round-trips it exactly.
    wire = padded.to(torch.uint8) if padded.dtype == torch.bool else padded.contiguous()
    parts = [torch.empty_like(wire) for _ in shapes]
    dist.all_gather(parts, wire)
    parts = [p[:s[0]].to(tensor.dtype) for p, s in zip(parts, shapes)]
    return torch.cat(parts)


def gather(data: Any, state: ProcessState) -> Any:
    """Concatenates each tensor of `data` across processes along the first dimension.

    Sizes along the first dimension may differ between ranks; other dimensions and the dtype
    must match. Every rank must pass the same structure (same keys, same list lengths).

    Args:
        data: A tensor, or dicts/lists/tuples of tensors; 0-dim tensors count as length 1.
        state: The calling Accelerator's process state.

    Returns:
        The same structure with each tensor replaced by the concatenation over ranks, in rank order.

    Raises:
        ValueError: on every rank alike, naming each rank's shape or dtype, when they mismatch.
    """
    if not state.is_distributed:
        return data
    return _map_tensors(lambda t: _gather_one(t, state), data)


# "mean" sums, then divides; "none" only scales. (Accelerate has "max"; "min" is its mirror.)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "none": None}


def reduce(data: Any, state: ProcessState, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sums, averages ("mean"), or takes the largest ("max") or smallest ("min") of each tensor of
    `data` across processes, element by element.

    Args:
        data: A tensor, or dicts/lists/tuples of tensors; the input is not modified.
        state: The calling Accelerator's process state.
        reduction: "sum", "mean", "max", "min", or "none" (only `scale` applies).
        scale: A factor applied after reducing.

    Raises:
        ValueError: for an unknown `reduction`.
    """
    check_choice("reduction", reduction, tuple(_REDUCE_OPS))
    op = _REDUCE_OPS[reduction]
    if state.is_distributed and op is not None:
        _verify_same_shapes("reduce", data, state)

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if state.is_distributed and op is not None:
            dist.all_reduce(out, op=op)
        if reduction == "mean":
            out = out / state.num_processes
        return out * scale if scale != 1.0 else out

    return _map_tensors(one, data)


def broadcast(data: Any, state: ProcessState, from_process: int = 0) -> Any:
    """Copies each tensor of `data` from `from_process` to every process (in place).

    Args:
        data: A tensor, or dicts/lists/tuples of tensors, of the same shapes on every rank.
        state: The calling Accelerator's process state.
        from_process: The rank whose values everyone receives.
    """
    if not state.is_distributed:
        return data
    _verify_same_shapes("broadcast", data, state)

    def one(tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=from_process)
        return tensor

    return _map_tensors(one, data)


def broadcast_object(obj: Any, state: ProcessState, from_process: int = 0) -> Any:
    """Returns `from_process`'s `obj` on every process.

    Args:
        obj: Any picklable object (ignored on the other ranks).
        state: The calling Accelerator's process state.
        from_process: The rank whose object everyone receives.
    """
    if not state.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=from_process)
    return box[0]


def pad_across_processes(data: Any, state: ProcessState, dim: int = 0, pad_index: int = 0,
                         pad_first: bool = False) -> Any:
    """Pads each tensor along `dim` to the largest size any process has, so it can be gathered.

    Args:
        data: A tensor, or dicts/lists/tuples of tensors.
        state: The calling Accelerator's process state.
        dim: The dimension to pad.
        pad_index: The fill value.
        pad_first: Pad at the start instead of the end.
    """
    if not state.is_distributed:
        return data

    def one(tensor: torch.Tensor) -> torch.Tensor:
        # Every process gathers, whatever its shape: one skipping the gather would hang the others.
        shapes = gather_object(tuple(tensor.shape), state)
        others = [s[:dim] + s[dim + 1:] for s in shapes] if tensor.ndim > dim else shapes
        if any(len(s) != tensor.ndim for s in shapes) or any(o != others[0] for o in others):
            listed = "\n  - ".join(f"Process {rank}: {shape}" for rank, shape in enumerate(shapes))
            raise DistributedOperationException(
                f"Cannot pad across processes along dim {dim}: the tensors must have the same number of dimensions "
                f"and the same sizes in every other dimension.\n\nOperation: `pad_across_processes`\nInput shapes:"
                f"\n  - {listed}")
        if tensor.ndim == 0 or dim >= tensor.ndim:
            return tensor
        longest = max(s[dim] for s in shapes)
        if tensor.shape[dim] == longest:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        filler = tensor.new_full(shape, pad_index)
        return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)

    return _map_tensors(one, data)


@contextlib.contextmanager
def split_between_processes(inputs: Any, state: ProcessState, apply_padding: bool = False) -> Iterator[Any]:
    """Yields this process's contiguous share of a list, tuple, tensor, Hugging Face Dataset (rows,
    with `select`) or dict of those.

    Shares differ by at most one element; with `apply_padding` the last element is repeated so
    all shares have equal length (gather then needs no uneven handling).

    Args:
        inputs: A list, tuple or tensor, or a dict of those (each value is split).
        state: The calling Accelerator's process state (no communication happens).
        apply_padding: Repeat the last element so every share has the same length.
    """
    n, rank = state.num_processes, state.process_index

    def share(seq: Any) -> Any:
        length = len(seq)
        per, extra = divmod(length, n)
        start = rank * per + min(rank, extra)
        end = start + per + (1 if rank < extra else 0)
        want = math.ceil(length / n)
        if _is_hf_dataset(seq):  # slicing gives a dict of columns: select rows instead, as Accelerate does
            rows = list(range(start, end))
            if apply_padding and len(rows) < want and length:
                rows += [length - 1] * (want - len(rows))
            return seq.select(rows)
        part = seq[start:end]
        if apply_padding and len(part) < want and length:
            pad = seq[-1:] * (want - len(part)) if not isinstance(seq, torch.Tensor) else seq[-1:].repeat(
                (want - len(part),) + (1,) * (seq.ndim - 1))
            part = torch.cat([part, pad]) if isinstance(seq, torch.Tensor) else part + pad
        return part

    if isinstance(inputs, dict):
        yield {k: share(v) for k, v in inputs.items()}
    else:
        yield share(inputs)


def _is_hf_dataset(seq: Any) -> bool:
    """Whether `seq` is a Hugging Face `datasets.Dataset` (looked up, never imported)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(seq, datasets.Dataset)


def sync_rng_states(rng_types: Any, state: ProcessState, generator: torch.Generator | None = None) -> None:
    """Gives every process of `state`'s group process 0's state of each generator in `rng_types`
    ("torch": the global CPU generator, "cuda": every CUDA device's, "generator": `generator`).

    Raises:
        ValueError: for another name, or "generator" without a generator.
    """
    for kind in rng_types:
        kind = getattr(kind, "value", kind)
        if kind == "torch":
            torch.set_rng_state(broadcast_object(torch.get_rng_state(), state))
        elif kind == "cuda":
            if torch.cuda.is_available():
                torch.cuda.set_rng_state_all(broadcast_object(torch.cuda.get_rng_state_all(), state))
        elif kind == "generator" and generator is not None:
            generator.set_state(broadcast_object(generator.get_state(), state))
        else:
            raise ValueError(f"`synchronize_rng_states` takes 'torch', 'cuda' and 'generator' (with a generator). "
                             f"Received: {kind!r} (generator={generator!r:.40}).")
