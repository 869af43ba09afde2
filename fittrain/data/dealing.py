"""Dealing one epoch's order to the processes: which batches this rank loads, and what was padding.

Two rules, both Accelerate's defaults (`split_batches=False`: each rank takes whole batches):

- `SampleDealer`, for loaders built with `batch_size`: the epoch's indices are cut into rounds of
  `batch_size * num_processes` samples and rank r takes the r-th slice of each round (with
  `split_batches=True`, the r-th part of each batch). With `even_batches=True` the last round is
  completed with samples from the start of the epoch, so all batches have one size.
- `BatchDealer`, for a custom `batch_sampler` or `batch_size=None` (each key is a ready batch):
  batch k of the epoch goes to rank k % num_processes. With `even_batches=True` the last round is
  completed with whole batches from the start of the epoch.

Either way every batch has a number in the epoch (round * num_processes + rank), the same as
in a one-process run for the same batch where the dealing allows it; workers seed from it.
One process has no peer to keep in step with: nothing is padded, as in plain PyTorch.

Continuing an epoch on another number of processes (an elastic resume): every method takes
`start`, the items of the epoch's order already consumed by the run that saved (samples, or
batches for `BatchDealer`). The rest, `order[start:]`, is dealt by the same rule as a whole epoch
(rounds from `start`), padding the last round from the start of the epoch as usual; batch numbers
go on from the consumed items (`start // batch_size`, or `start`), so a batch keeps the number a
one-process run gives it. `consumed` turns a rank's batch count back into items of the order.
"""

from __future__ import annotations

from typing import Any, Iterator


class SampleDealer:
    """Deals an epoch's sample indices to ranks in batches of the loader's batch size.

    Args:
        declared: Samples in an epoch as the sampler's len() says (for `len()` before a pass).
        batch_size: The loader's batch size.
        drop_last: Drop the incomplete last round.
        num_processes: World size.
        process_index: This rank.
        split_batches: Split each batch across ranks instead of giving each rank whole batches.
        even_batches: Pad the last round so every rank takes the same number of steps.
    """

    def __init__(self, declared: int, batch_size: int, drop_last: bool, num_processes: int, process_index: int,
                 split_batches: bool, even_batches: bool) -> None:
        self.declared, self.drop_last = declared, drop_last
        self.num_processes, self.process_index = num_processes, process_index
        # Per-process batch size: the loader's, or its share of it when batches are split.
        self.batch_size = batch_size // num_processes if split_batches else batch_size
        self.round_size = self.batch_size * num_processes
        # One process has no peer to keep in step with, so its last batch stays short.
        self.pads = even_batches and num_processes > 1 and not drop_last

    def count(self, n: int, start: int = 0) -> int:
        """Batches this rank takes from samples `start`..`n - 1` of an epoch of `n` samples."""
        full, rest = divmod(n - start, self.round_size)
        if rest == 0 or self.drop_last:
            return full
        if self.pads:
            return full + 1
        # Uneven tail: ranks past the remaining samples get no last batch.
        return full + (1 if rest > self.process_index * self.batch_size else 0)

    def __len__(self) -> int:
        return self.count(self.declared)

    def flatten(self, batches: list[list[int]]) -> list[int]:
        """The epoch's indices, from the loader's own batch sampler's batches."""
        return [i for batch in batches for i in batch]

    def deal(self, indices: list[int], skip: int, start: int = 0) -> Iterator[tuple[int, list[int]]]:
        """This rank's (batch number, indices) from its batch `skip` on of the rest `indices[start:]`."""
        mine = self.process_index * self.batch_size
        first = start // self.batch_size + self.process_index
        for k in range(skip, self.count(len(indices), start)):
            at = start + k * self.round_size
            chunk = indices[at:at + self.round_size]
            if self.pads and len(chunk) < self.round_size:
                # Complete the last round from the start of the epoch, as Accelerate does, so every
                # rank takes the same number of steps; gather_for_metrics drops these repeats.
                chunk = chunk + [indices[i % len(indices)] for i in range(self.round_size - len(chunk))]
            yield first + k * self.num_processes, chunk[mine:mine + self.batch_size]

    def padding(self, indices: list[int], start: int = 0) -> tuple[int, int]:
        """(real samples in the padded last round, 0), or (0, 0) when nothing was padded."""
        rest = (len(indices) - start) % self.round_size
        # One process trims too, as Accelerate does (its remainder is len % total batch size): a value
        # repeated per sample of the last, short batch (`loss.repeat(batch_size)`) keeps its weight.
        trims = self.pads or (self.num_processes == 1 and not self.drop_last)
        return (rest if trims else 0), 0

    def consumed(self, taken: int, n: int, start: int = 0) -> int:
        """Samples of the epoch's order consumed by all ranks together once this rank took `taken`
        batches of a pass from `start` (all of them once it took its last batch)."""
        return n if taken >= self.count(n, start) else min(start + taken * self.round_size, n)


class BatchDealer:
    """Deals an epoch's ready batches (index batches or keys) to ranks, whole: batch k to rank k % N.

    Args:
        declared: Batches in an epoch as the (batch) sampler's len() says.
        num_processes: World size.
        process_index: This rank.
        even_batches: Pad the last round with batches from the start so ranks stay in step.
        sized: True when a batch's sample count is its index list's length (a batch_sampler);
            False for keys of ready batches, whose size is known only once loaded.
    """

    def __init__(self, declared: int, num_processes: int, process_index: int, even_batches: bool,
                 sized: bool) -> None:
        self.declared, self.sized = declared, sized
        self.num_processes, self.process_index = num_processes, process_index
        self.pads = even_batches and num_processes > 1

    def count(self, n: int, start: int = 0) -> int:
        """Batches this rank takes from batches `start`..`n - 1` of an epoch of `n` batches."""
        rounds, rest = divmod(n - start, self.num_processes)
        if rest and (self.pads or self.process_index < rest):
            rounds += 1
        return rounds

    def __len__(self) -> int:
        return self.count(self.declared)

    def deal(self, batches: list[Any], skip: int, start: int = 0) -> Iterator[tuple[int, Any]]:
        """This rank's (batch number, batch) from its batch `skip` on of the rest `batches[start:]`."""
        n = len(batches)
        for i in range(skip, self.count(n, start)):
            k = start + i * self.num_processes + self.process_index
            # Past the end: padding, taken from the start of the epoch.
            yield k, batches[k] if k < n else batches[(k - n) % n]

    def padding(self, batches: list[Any], start: int = 0) -> tuple[int, int]:
        """What gather_for_metrics keeps of the padded last round: (real samples, 0) when sizes are
        known, else (0, ranks whose batch is real); (0, 0) when nothing was padded."""
        rest = (len(batches) - start) % self.num_processes
        if not (self.pads and rest):
            return 0, 0
        if self.sized:
            return sum(len(batch) for batch in batches[len(batches) - rest:]), 0
        return 0, rest

    def consumed(self, taken: int, n: int, start: int = 0) -> int:
        """Batches of the epoch's order consumed by all ranks together once this rank took `taken`
        batches of a pass from `start` (all of them once it took its last batch)."""
        return n if taken >= self.count(n, start) else min(start + taken * self.num_processes, n)
