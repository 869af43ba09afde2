"""`fittrain.utils`: the user-facing helpers Accelerate scripts import from `accelerate.utils`.

`from accelerate.utils import set_seed, ProjectConfiguration` becomes `from fittrain.utils
import ...`. The collectives here work like the Accelerator's methods of the same names, on the
process group of this process (a `PartialState` is read per call; there is no global to set up).
Accelerate's whole `is_*_available` family is here too (`fittrain.common.availability`): each answers
for this machine whether a package is installed or a device present.

A facade for user scripts: nothing inside fittrain imports it. Most names are re-exported from
the subpackage that owns them (`send_to_device` and `skip_first_batches` from `fittrain.data`);
the thin wrappers here read this process's `PartialState` per call.

Example:
    >>> from fittrain.utils import set_seed, gather_object
    >>> set_seed(42)
    >>> everyone = gather_object([f"rank {PartialState().process_index}"])
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm as _tqdm

from fittrain.accelerator.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from fittrain.accelerator.partial_state import PartialState
from fittrain.accelerator.seeding import set_seed
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.common import availability
from fittrain.common.availability import *  # noqa: F403 - Accelerate's is_*_available family, listed in __all__
from fittrain.data.devices import send_to_device
from fittrain.data.skipping import skip_first_batches
from fittrain.distributed import collectives
from fittrain.distributed.collectives import DistributedOperationException, sync_rng_states
from fittrain.distributed.process_state import DistributedType
from fittrain.trackers.registry import LoggerType

__all__ = [
    "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
    "DistributedType", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs", "LoggerType",
    "ProfileKwargs", "TorchDynamoPlugin", "ProjectConfiguration", "DistributedOperationException", "broadcast",
    "broadcast_object_list", "find_executable_batch_size", "gather", "gather_object", "pad_across_processes",
    "reduce", "send_to_device", "set_seed", "skip_first_batches", "synchronize_rng_states", "tqdm",
    "wait_for_everyone",
] + availability.__all__

# What an out-of-memory failure says, on each device kind (CPU allocations fail with the last one).
_OOM_MESSAGES = ("out of memory", "CUDNN_STATUS_NOT_SUPPORTED", "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
                 "DefaultCPUAllocator: can't allocate memory")


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> _tqdm:
    """`tqdm.auto.tqdm` that shows on the local main process only (unless `main_process_only=False`)."""
    if main_process_only and not PartialState().is_local_main_process:
        kwargs["disable"] = True
    return _tqdm(*args, **kwargs)


def wait_for_everyone() -> None:
    """Blocks until every process reaches this line."""
    PartialState().wait_for_everyone()


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Gives every process the main process's state of each generator in `rng_types`.

    Args:
        rng_types: "torch" (the global CPU generator), "cuda" (every CUDA device's), "generator"
            (the `generator` passed).
        generator: The generator for "generator".

    Raises:
        ValueError: for another name (xla, npu, ...), or "generator" without a generator.
    """
    sync_rng_states(rng_types, PartialState().state, generator)


def gather(tensor: Any) -> Any:
    """Concatenates tensors (or nested structures of them) from every process along dim 0."""
    return collectives.gather(tensor, PartialState().state)


def gather_object(object: Any) -> Any:
    """Every process's list of picklable objects, joined in rank order (one process: `object` itself)."""
    state = PartialState().state
    if not state.is_distributed:
        return object
    return [item for part in collectives.gather_object(object, state) for item in part]


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduces tensors across processes: "mean" (the default here, as in `accelerate.utils`),
    "sum", "max", "min" or "none"."""
    return collectives.reduce(tensor, PartialState().state, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copies tensors (or nested structures of them) from `from_process` to every process."""
    return collectives.broadcast(tensor, PartialState().state, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replaces the items of `object_list`, in place, with those of `from_process`; returns it."""
    if not isinstance(object_list, list):
        raise TypeError(f"`object_list` must be a list (it is filled in place). Received: "
                        f"{type(object_list).__name__}. Wrap the object: broadcast_object_list([obj]).")
    object_list[:] = collectives.broadcast_object(list(object_list), PartialState().state, from_process)
    return object_list


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pads tensors along `dim` to the largest size any process has, with `pad_index`."""
    return collectives.pad_across_processes(tensor, PartialState().state, dim, pad_index, pad_first)


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Callable[..., Any]:
    """Calls `function(batch_size, ...)` with smaller batch sizes until it runs out of memory no more.

    `function` takes the batch size as its first argument, which the caller leaves out. After an
    out-of-memory error the batch size becomes 90% of itself (or what `reduce_batch_size_fn`
    returns), and the device cache is cleared.

    Example:
        >>> @find_executable_batch_size(starting_batch_size=128)
        ... def train(batch_size, model):
        ...     ...
        >>> train(model)

    Raises:
        RuntimeError: when the batch size reached zero.
        TypeError: when the caller passes the batch size too.
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(f"`{function.__name__}` got its batch size from the call, but find_executable_batch_size "
                            f"passes it as the first argument. Call {function.__name__}(...) without it.")
        while True:
            if batch_size <= 0:
                raise RuntimeError(f"`{function.__name__}` ran out of memory down to batch size 1 (started at "
                                   f"{starting_batch_size}): no executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - only out-of-memory errors retry
                if not _is_out_of_memory(err):
                    raise
                _free_device_cache()
                batch_size = reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    return run


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and len(err.args) == 1 and any(m in str(err.args[0]) for m in _OOM_MESSAGES)


def _free_device_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
