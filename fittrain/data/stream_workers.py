"""The part of a prepared stream that runs where the user's dataset is iterated: in each
DataLoader worker, or in the main process without workers.

`RankStream` wraps the user's IterableDataset. It reads the worker's stream in *rounds*: with a
`batch_size` B and N ranks a round is B*N samples, and rank r batches samples [r*B, (r+1)*B) of
it; over a `batch_size=None` loader (a stream of ready batches) a round is N items and rank r
takes item r. Every rank reads the whole stream, so every rank sees the same rounds and ends its
pass at the same batch, with no collective. Each yielded item carries what the main process
needs to keep the pass resumable: the worker, the rounds it has read, the round's padding, and
the dataset's own `state_dict()` when it has one.

The last round of a worker's stream may be short. With `drop_last` it is dropped. Otherwise,
with several ranks and `even_batches`, it is completed by repeating its own samples, so every
rank still takes a batch; the item says how many samples were real (`remainder`), which
`gather_for_metrics` keeps. (Repeating the round itself, not the start of the pass, means a
resumed run needs nothing but the current position.)
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from fittrain.data.devices import batch_size_of
from fittrain.data.stream_state import has_state
from fittrain.data.workers import mix_seed, seed_worker_rngs


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """How one rank cuts a stream into its batches.

    Attributes:
        batch_size: Samples per batch, or None for a stream of ready batches.
        num_processes: Ranks sharing the stream (1 when the dataset shards itself by rank).
        process_index: This rank among them.
        drop_last: Drop a short last round instead of yielding it.
        pads: Complete a short last round so that every rank takes a batch (even_batches).
    """

    batch_size: int | None
    num_processes: int
    process_index: int
    drop_last: bool
    pads: bool

    @property
    def round_length(self) -> int:
        """Samples (or ready batches) read per round."""
        return (self.batch_size or 1) * self.num_processes


class StreamItem(NamedTuple):
    """What a worker reports with each batch (or, with `done`, once when its stream is over)."""

    worker: int
    rounds: int
    remainder: int
    dataset_state: Any
    done: bool


def keep_as_is(item: Any) -> Any:
    """The collate_fn of the inner loader: `RankStream` already collated the batch."""
    return item


class RankStream(IterableDataset):
    """This rank's batches of the user's stream, read round by round (see the module docstring).

    Args:
        dataset: The user's IterableDataset.
        layout: How this rank cuts the stream into batches.
        collate_fn: The user's loader's collate_fn.
        starts: Per worker, where a resumed pass continues: `{"rounds", "dataset_state", "done"}`.
        replays: Whether to reach a start by reading its rounds again rather than by loading
            the dataset's state (which is missing or inexact).
        base_seed: Seeds each round's RNGs in a worker.
    """

    def __init__(self, dataset: Any, layout: StreamLayout, collate_fn: Callable[[Any], Any],
                 starts: dict[int, dict[str, Any]], replays: bool, base_seed: int) -> None:
        self.dataset, self.layout, self.collate_fn = dataset, layout, collate_fn
        self.starts, self.replays, self.base_seed = starts, replays, base_seed

    def __iter__(self) -> Iterator[tuple[Any, StreamItem]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        start = self.starts.get(worker, {})
        rounds = int(start.get("rounds", 0))
        if not start.get("done", False):
            yield from self._batches(worker, rounds, start.get("dataset_state"), info is not None)
        yield None, StreamItem(worker, rounds, 0, None, True)

    def _batches(self, worker: int, rounds: int, state: Any, in_worker: bool) -> Iterator[tuple[Any, StreamItem]]:
        replay = rounds if (self.replays or state is None) else 0
        if rounds and not replay:
            self.dataset.load_state_dict(state)
        stateful = has_state(self.dataset)
        samples = iter(self.dataset)
        for done in range(rounds - replay, rounds):  # a replay reads the consumed rounds without batching
            self._read_round(samples, worker, done, in_worker)
        length = self.layout.round_length
        while True:
            real = self._read_round(samples, worker, rounds, in_worker)
            if not real or (len(real) < length and self.layout.drop_last):
                return
            rounds += 1
            mine, remainder = self._share(real)
            if mine:
                batch = self.collate_fn(mine) if self.layout.batch_size else self.collate_fn(mine[0])
                yield batch, StreamItem(worker, rounds, remainder,
                                        self.dataset.state_dict() if stateful else None, False)
            if len(real) < length:
                return

    def _read_round(self, samples: Iterator[Any], worker: int, index: int, in_worker: bool) -> list[Any]:
        if in_worker:
            # Per round, so randomness inside the stream does not depend on how far a resumed run replayed.
            seed_worker_rngs(mix_seed(self.base_seed, worker, index))
        return list(itertools.islice(samples, self.layout.round_length))

    def _share(self, real: list[Any]) -> tuple[list[Any], int]:
        """This rank's samples of a round (a list of one item for ready batches), and the real
        samples of the round when it was padded (else 0)."""
        layout, length = self.layout, self.layout.round_length
        remainder = 0
        if len(real) < length and layout.pads:
            remainder = len(real) if layout.batch_size else sum(batch_size_of(item) for item in real)
            real = [real[i % len(real)] for i in range(length)]
        size = layout.batch_size or 1
        return real[layout.process_index * size:(layout.process_index + 1) * size], remainder
