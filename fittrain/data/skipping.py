"""`skip_first_batches`: one pass of a prepared loader that starts after its first batches."""

from __future__ import annotations

from typing import Any, Iterator

from fittrain.common.reprs import short_repr
from fittrain.data.map_style import DataLoaderShard


def check_skip_count(num_batches: Any) -> int:
    """Returns `num_batches` when it is a count of batches to skip (an int >= 0).

    The one check of `skip_first_batches`' count: the Accelerator's method, `fittrain.utils`' function
    and `SkippedDataLoader` all refuse a bad count with it, at the call.

    Raises:
        TypeError: for anything but an int (a bool, a str such as "3", a float such as 1.5).
        ValueError: for a negative int.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int):
        raise TypeError(f"`num_batches` must be a non-negative integer. Received: "
                        f"num_batches={short_repr(num_batches)} (type {type(num_batches).__name__}). Pass the number "
                        "of batches to skip as an int, such as loader.position.batches_consumed after load_state().")
    if num_batches < 0:
        raise ValueError(f"`num_batches` must be a non-negative integer. Received: num_batches={num_batches}. Pass the "
                         "number of batches to skip, 0 or more, such as loader.position.batches_consumed.")
    return num_batches


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
