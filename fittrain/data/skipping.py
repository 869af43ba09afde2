"""`skip_first_batches`: one pass of a prepared loader that starts after its first batches."""

from __future__ import annotations

from typing import Any, Iterator

from .map_style import DataLoaderShard


class SkippedDataLoader:
    """One pass of a prepared loader that starts after its first `num_batches` batches.

    It shares the loader's position, so after this pass the loader continues with the next epoch.
    """

    def __init__(self, loader: DataLoaderShard, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = num_batches

    def __len__(self) -> int:
        # Not len(loader) - num_batches: an epoch re-dealt after an elastic resume has its own length.
        return self.loader.batches_left(self.num_batches)

    def __iter__(self) -> Iterator[Any]:
        return self.loader.iterate(skip=self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
