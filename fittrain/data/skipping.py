"""`skip_first_batches`: one pass of a loader that starts after its first batches.

A prepared loader (`SkippedDataLoader`) and a plain map-style DataLoader skip them without loading
them; any other iterable is read and its first batches dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from fittrain.common.checks import check_non_negative_int
from fittrain.data.map_style import DataLoaderShard
from fittrain.data.position import PositionedSource


def check_skip_count(num_batches: Any) -> int:
    """Returns `num_batches` when it is a count of batches to skip (an int >= 0).

    The one check of `skip_first_batches`' count: the Accelerator's method, the function below
    and `SkippedDataLoader` all refuse a bad count with it, at the call.

    Raises:
        ArgumentTypeError: (a TypeError) for anything but an int (a bool, a str such as "3", a float).
        ValueError: for a negative int.
    """
    return check_non_negative_int("num_batches", num_batches, fix=(
        "Pass the number of batches to skip, 0 or more, as an int, such as loader.position.batches_consumed "
        "after load_state()."))


class SkippedDataLoader:
    """One pass of a prepared loader that starts after its first `num_batches` batches.

    It shares the loader's position, so after this pass the loader continues with the next epoch.

    Raises:
        TypeError, ValueError: for a `num_batches` that is not an int >= 0 (`check_skip_count`).
    """

    def __init__(self, loader: DataLoaderShard, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = check_skip_count(num_batches)

    def __len__(self) -> int:
        # Not len(loader) - num_batches: an epoch re-dealt after an elastic resume has its own length.
        return self.loader.batches_left(self.num_batches)

    def __iter__(self) -> Iterator[Any]:
        return self.loader.iterate(skip=self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """One pass of `dataloader` that starts after its first `num_batches` batches.

    A prepared loader skips them without loading them (see `Accelerator.skip_first_batches`); a
    plain map-style DataLoader becomes the same DataLoader over its batch sampler minus the first
    batches, also without loading them; any other iterable is read and its first batches dropped.
    """
    check_skip_count(num_batches)
    if isinstance(dataloader, (PositionedSource, SkippedDataLoader)):
        return SkippedDataLoader(getattr(dataloader, "loader", dataloader), num_batches)
    if isinstance(dataloader, DataLoader) and dataloader.batch_sampler is not None \
            and not isinstance(dataloader.dataset, IterableDataset):
        # The same loader over a batch sampler that drops its first batches: the order is drawn
        # exactly as the original would draw it, and the skipped batches are never loaded.
        return DataLoader(dataloader.dataset, batch_sampler=_SkipBatches(dataloader.batch_sampler, num_batches),
                          num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                          pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
                          worker_init_fn=dataloader.worker_init_fn, generator=dataloader.generator,
                          multiprocessing_context=dataloader.multiprocessing_context,
                          prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers)
    return _SkipFirst(dataloader, num_batches)


class _SkipBatches:
    """A batch sampler without the first `num_batches` batches of `batch_sampler`."""

    def __init__(self, batch_sampler: Any, num_batches: int) -> None:
        self.batch_sampler = batch_sampler
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.num_batches, 0)

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.batch_sampler):
            if index >= self.num_batches:
                yield batch


class _SkipFirst:
    """One pass of any other iterable after its first batches (they are read, then dropped)."""

    def __init__(self, loader: Any, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.loader):
            if index >= self.num_batches:
                yield batch
