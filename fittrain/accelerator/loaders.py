"""Preparing one data loader for an Accelerator: sharding, placement, padding, checks across processes.

`Accelerator.prepare_data_loader` calls `prepare_loader`, which picks the shard for what it was
given (a DataLoader over a map-style dataset, a stream over an IterableDataset, or a list of
ready batches: `fittrain.data`) and checks, with one small collective, that every process passed
a loader of the same length.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from fittrain.data import BatchesShard, DataLoaderShard, PositionedSource, StreamShard
from fittrain.data.seedable import with_seedable_sampler
from fittrain.distributed import collectives
from fittrain.distributed.collectives import sync_rng_states

if TYPE_CHECKING:  # annotations only: the Accelerator imports this module
    from fittrain.accelerator.accelerator import Accelerator


def prepare_loader(accelerator: "Accelerator", data_loader: Any, device: torch.device | None, even: bool,
                   synced_rng: Any) -> PositionedSource:
    """The prepared form of `data_loader` for `accelerator`'s processes (not yet registered).

    Args:
        accelerator: Read for its public configuration: `state`, `gradient_state`,
            `dataloader_config`, `split_batches`.
        data_loader: A DataLoader, or a re-iterable sized sequence of ready batches.
        device: Where batches go; None leaves them where they are.
        even: Pad the last round so every process takes the same number of batches.
        synced_rng: Accelerate's `rng_types` beyond "generator", or an empty value.
    """
    state, config = accelerator.state, accelerator.dataloader_config
    ranks, rank = data_parallel_ranks(accelerator)
    shard: PositionedSource
    if isinstance(data_loader, DataLoader) and isinstance(data_loader.dataset, IterableDataset):
        shard = _stream(accelerator, data_loader, device, even)
    elif not isinstance(data_loader, DataLoader):
        shard = BatchesShard(data_loader, device, accelerator.gradient_state, ranks, rank, even)
        _check_same_length(accelerator, len(data_loader), "batches")
    else:
        if config.use_seedable_sampler:
            data_loader = with_seedable_sampler(data_loader, config.data_seed)
        # Every pass draws the user's order from rank 0's RNG state, broadcast once per epoch.
        shard = DataLoaderShard(data_loader, device, accelerator.gradient_state, ranks, rank,
                                accelerator.split_batches, even,
                                share=lambda obj: collectives.broadcast_object(obj, state))
        _check_same_length(accelerator, *shard.length_check)
    # Pinned memory copies asynchronously anyway; DataLoaderConfiguration(non_blocking=True) always.
    shard._non_blocking = shard._non_blocking or config.non_blocking
    shard.resumes_itself = config.use_stateful_dataloader
    if synced_rng:  # Accelerate's rng_types=["torch", "cuda"]: process 0's generators at each pass
        shard.sync_rng = functools.partial(sync_rng_states, synced_rng, state)
    return shard


def data_parallel_ranks(accelerator: "Accelerator") -> tuple[int, int]:
    """(number of data-parallel ranks, this process's): the processes and this one's index, unless
    a `parallelism_config` puts several processes in one tensor-parallel group, which share a rank."""
    layout = accelerator.parallelism_config
    size = accelerator.state.num_processes if layout is None else layout.data_parallel_size
    return size, accelerator.data_parallel_rank


def _check_same_length(accelerator: "Accelerator", length: int, unit: str) -> None:
    """Checks that every process passed a loader of the same length.

    One small collective at prepare time. Loaders of different lengths would give the processes
    different numbers of batches, and the first process to run out would leave the others
    waiting in a collective until the timeout, so every process raises the same error instead.
    """
    lengths = collectives.gather_object(length, accelerator.state)
    if len(set(lengths)) > 1:
        listed = ", ".join(f"process {rank}: {n} {unit}" for rank, n in enumerate(lengths))
        raise ValueError(
            f"The data loaders prepared on different processes have different lengths ({listed}). Every "
            "process must pass the same, whole dataset: fittrain gives each process its share. Build the "
            "dataset identically on every process (same files, same filtering, same seed).")


def _stream(accelerator: "Accelerator", loader: DataLoader, device: torch.device | None, even: bool) -> StreamShard:
    if accelerator.split_batches:
        raise ValueError(
            "`split_batches=True` cannot split the batches of a stream (a DataLoader over an IterableDataset): "
            f"received one over {type(loader.dataset).__name__}. Use split_batches=False (the default); every "
            "process then takes whole batches of the loader's batch_size.")
    state = accelerator.state

    def all_agree(flag: bool) -> bool:
        """True on every process when `flag` is True on every process (one small all-reduce)."""
        total = collectives.reduce(torch.tensor([int(flag)], device=state.device), state)
        return int(total.item()) == state.num_processes

    return StreamShard(loader, device, accelerator.gradient_state, *data_parallel_ranks(accelerator),
                       even, agree=all_agree)
