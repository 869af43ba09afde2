"""Pre-built batches as a prepared data source: a list (or other sized iterable) of ready batches.

Users who build their batches once, or stream them from their own code, should not have to
wrap them in a DataLoader to train: a DataLoader over ready batches only adds its own per-batch
cost. A `BatchesShard` iterates the batches as they are, in order, and tracks the same position
as a prepared DataLoader, so checkpoints and exact resume work unchanged (skipping on resume
walks past the first batches without touching them).

With several processes each rank takes every `num_processes`-th batch (rank r: batches r, r+N,
...), the same whole-batch interleaving a prepared DataLoader uses. With `even_batches=True` the
last round is completed with batches from the start, so every rank takes the same number of steps.

The state counts the batches of the epoch consumed by all processes together (`order_consumed`),
so a resume on another number of processes deals the rest of the epoch to its processes, by the
same rule from that batch on (`dealing.BatchDealer`), as long as every process has the same list.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch

from fittrain.data.dealing import BatchDealer
from fittrain.data.devices import batch_size_of
from fittrain.data.position import DataPosition, PositionedSource
from fittrain.distributed.gradient_state import GradientState


def check_batches(batches: Any, name: str) -> None:
    """Raises a clear error unless `batches` can be iterated once per epoch and has a length.

    Raises:
        TypeError: for a one-shot iterator (such as a generator) or an object without `len()`.
    """
    if iter(batches) is batches:
        raise TypeError(
            f"`{name}` must be a DataLoader or a re-iterable sequence of batches with a length, such as a list. "
            f"Received a one-shot iterator ({type(batches).__name__}), which would run out after one epoch and "
            f"cannot be resumed. Pass list(...) of the batches, or a DataLoader.")
    try:
        len(batches)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a DataLoader or a sequence of batches with a length, such as a list. Received: "
            f"{type(batches).__name__}, which has no len(). Pass list(...) of the batches, or a DataLoader.") from None


class BatchesShard(PositionedSource):
    """This rank's share of a sequence of ready batches, on the device, with a resumable position.

    Args:
        batches: A list, tuple, or any sized iterable that can be iterated again each epoch.
        device: Where batches go, or None to leave them where they are.
        gradient_state: The owning Accelerator's accumulation state (`end_of_dataloader`).
        num_processes: World size.
        process_index: This rank.
        even_batches: Complete the last round with batches from the start so ranks stay in step.
    """

    def __init__(self, batches: Any, device: torch.device | None, gradient_state: GradientState,
                 num_processes: int = 1, process_index: int = 0, even_batches: bool = True) -> None:
        check_batches(batches, "data_loader")  # the argument of prepare_data_loader, which builds this
        self.base_loader = batches
        self.device = device
        self.gradient_state = gradient_state
        self.num_processes, self.process_index, self.even_batches = num_processes, process_index, even_batches
        # Counts only: the batches are read lazily here, never indexed.
        self._dealer = BatchDealer(len(batches), num_processes, process_index, even_batches, sized=False)
        self.position = DataPosition()
        # On the CPU a batch is already where it belongs: skip the recursive walk.
        self._moves_batches = device is not None and device.type != "cpu"

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes, read off the first batch (None without tensors);
        the Logger's samples/sec uses it."""
        first = next(iter(self.base_loader), None)
        size = batch_size_of(first) if first is not None else 0
        return size * self.num_processes or None

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        return self._dealer.count(len(self.base_loader))

    def batches_left(self, skip: int) -> int:
        """Batches that a pass of the current epoch from batch `skip` yields on this rank."""
        position = self.position
        start, first = (position.start_items, position.start_batch) if skip and position.start_batch else (0, 0)
        return max(first + self._dealer.count(len(self.base_loader), start) - skip, 0)

    def _order_consumed(self) -> int | None:
        position = self.position
        taken = position.batches_consumed - position.start_batch
        if taken <= 0:
            return position.start_items
        return self._dealer.consumed(taken, len(self.base_loader), position.start_items)

    def _epoch_items(self) -> int:
        return len(self.base_loader)

    def _rank_batches(self, start: int) -> Iterator[Any]:
        """This rank's batches of the epoch's rest, batches `start`.. (all of it for start 0)."""
        n, world, rank = len(self.base_loader), self.num_processes, self.process_index
        if world == 1:
            return itertools.islice(self.base_loader, start, None)
        mine = itertools.islice(self.base_loader, start + rank, None, world)
        rest = (n - start) % world
        if not (self.even_batches and rest and rank >= rest):
            return mine
        # This rank has no batch in the last round: borrow one from the start of the epoch.
        borrowed = (start + (n - start) // world * world + rank - n) % n
        return itertools.chain(mine, itertools.islice(self.base_loader, borrowed, borrowed + 1))

    def iterate(self, skip: int) -> Iterator[Any]:
        """Runs the current epoch from batch `skip` on; skipped batches are passed over, not moved."""
        self.sync_rng()
        start, first = self._pass_start(skip)
        total = first + self._dealer.count(len(self.base_loader), start)
        # A padded last round: ranks from `rest` on repeat a batch, which gather_for_metrics drops.
        rest = (len(self.base_loader) - start) % self.num_processes
        real_ranks = rest if (self.even_batches and rest) else 0
        batches = itertools.islice(self._rank_batches(start), skip - first, total - first)
        yield from self._emit(batches, skip, total, real_ranks=real_ranks)
