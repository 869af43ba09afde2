"""A prepared DataLoader over an IterableDataset: this rank's share of a stream, resumable exactly.

Sharding: every rank reads the whole stream and keeps its share of each round (see
`stream_workers`): the I/O and the dataset's own per-sample work are paid N times, collation and
the transfer to the device once. In exchange the ranks need no collective to agree on anything,
and they end every pass at the same batch. A dataset that shards itself by rank (Hugging Face's
`split_dataset_by_node`, or any dataset with `shards_by_rank = True`) is read as it is; its ranks
may then run out at different batches, so they agree on every batch with one small all-reduce
and stop together at the first rank's end (the other ranks' extra batches are not used; a
warning counts them).

Workers: with `num_workers=W`, each worker iterates its own copy of the dataset, which splits
itself by `torch.utils.data.get_worker_info()` as in plain PyTorch; rank sharding happens inside
each worker's share. Batches come out round-robin over the workers still running, as in plain
PyTorch, and the pass records each worker's progress, so a resumed pass restarts every worker
where it was and continues the round-robin at the right worker.

Resume: the pass state (per worker: rounds read, the dataset's `state_dict()` when it has one)
is part of `state_dict()`, saved per rank. A dataset whose state resumes exactly is restored from
it; otherwise each worker replays its stream and passes over the rounds already consumed, which
is exact for a deterministic stream (a warning says so, with the count, for a stream without
state). Hugging Face streams with a shuffle buffer are replayed: their state omits the buffer.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from fittrain.data.devices import send_to_device
from fittrain.data.position import DataPosition, PositionedSource
from fittrain.data.stream_state import has_state, shards_by_rank, state_is_exact
from fittrain.data.stream_workers import RankStream, StreamItem, StreamLayout, keep_as_is
from fittrain.data.workers import init_worker, mix_seed
from fittrain.distributed.gradient_state import GradientState


def _fresh_pass(workers: int, base_seed: int = 0) -> dict[str, Any]:
    return {"base_seed": base_seed, "next_worker": 0,
            "workers": [{"rounds": 0, "dataset_state": None, "done": False} for _ in range(workers)]}


class StreamShard(PositionedSource):
    """This rank's batches of a DataLoader over an IterableDataset, on the device, resumable.

    An epoch is one pass over the stream. It has no length: `len()` raises a TypeError.

    Args:
        loader: The user's DataLoader; its dataset, batch_size, drop_last, collate_fn and worker
            settings are kept (workers are started afresh each pass, to carry the resume state).
        device: Where batches go, or None to leave them where the loader made them.
        gradient_state: The owning Accelerator's accumulation state.
        num_processes: World size.
        process_index: This rank.
        even_batches: Complete a short last round so every rank takes the same number of steps.
        agree: For a dataset that shards itself over several ranks: returns True on every rank
            when every rank passed True (an all-reduce), so ranks stop together.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None, gradient_state: GradientState,
                 num_processes: int = 1, process_index: int = 0, even_batches: bool = True,
                 agree: Callable[[bool], bool] | None = None) -> None:
        dataset = loader.dataset
        own_shards = shards_by_rank(dataset)
        ranks = 1 if own_shards else num_processes
        self.layout = StreamLayout(loader.batch_size, ranks, 0 if own_shards else process_index,
                                   loader.drop_last, even_batches and ranks > 1)
        self.base_loader, self.device, self.gradient_state = loader, device, gradient_state
        self.num_processes = num_processes
        self._agree = agree if (own_shards and num_processes > 1) else None
        self._workers = max(loader.num_workers, 1)
        self._replays = not (has_state(dataset) and state_is_exact(dataset))
        self.position = DataPosition()
        self._pass = _fresh_pass(self._workers)
        self._loaded: dict[str, Any] | None = None  # a checkpoint's pass state, for the next iterate()
        self._moves_batches = device is not None and device.type != "cpu"
        self._non_blocking = bool(loader.pin_memory)

    # ----------------------------------------------------------------- sizes
    def __len__(self) -> int:
        raise TypeError(
            f"A prepared DataLoader over an IterableDataset ({type(self.base_loader.dataset).__name__}) has no "
            "length: a stream is read until it ends. Train to `max_steps`, or count batches as they come.")

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        return self.base_loader.dataset

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this process (None for a stream of ready batches)."""
        return self.layout.batch_size

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all processes (None for a stream of ready batches)."""
        return None if self.batch_size is None else self.batch_size * self.layout.num_processes

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The position and the pass state (per worker: rounds read, the dataset's state), copied:
        the live pass state changes with every batch."""
        return {**super().state_dict(), "stream": copy.deepcopy(self._pass)}

    # No `_epoch_items`: a stream's length is known only once it ends, so a saved position in it
    # cannot be bounded before it is read (`PositionedSource.check_position` lets it through).

    def _order_consumed(self) -> int | None:
        # Each rank read its own share of the pass: only a pass not begun can start on other ranks.
        return 0 if self.position.batches_consumed == 0 else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position; the next `iterate(skip=batches_consumed)` continues the pass.

        A state saved by another number of processes loads only between passes (nothing of the
        epoch read yet, `order_consumed` 0): a pass under way is each rank's own share of the stream.
        """
        saved = state.get("stream")
        if saved is not None:
            _check_pass(saved, self._workers)
        super().load_state_dict(state)
        self._loaded = copy.deepcopy(saved)

    # ----------------------------------------------------------------- iteration
    def iterate(self, skip: int) -> Iterator[Any]:
        """Runs the current pass from batch `skip` on: from the saved pass state when a checkpoint
        left off there, else by reading and discarding the first `skip` batches."""
        self.sync_rng()
        loaded, self._loaded = self._loaded, None
        if skip and loaded is None:
            warnings.warn(f"Skipping the first {skip} batches of a stream by reading them: no saved pass state "
                          "says where they ended. This is exact only for a deterministic stream.", stacklevel=2)
            items = self._items(_fresh_pass(self._workers, self._draw_seed()))
            for _, item in itertools.islice(items, skip):
                self._record(item)
            return self._emit_stream(items, skip)
        if not skip:
            loaded = _fresh_pass(self._workers, self._draw_seed())
        elif not has_state(self.dataset):
            warnings.warn(
                f"Resuming {type(self.dataset).__name__}, a stream without state_dict()/load_state_dict(), by reading "
                f"again the {skip} batches this rank consumed in its pass and passing over them. This is exact only "
                "if the stream yields the same samples in the same order each time it is read.", stacklevel=2)
        return self._emit_stream(self._items(loaded), skip)

    def _draw_seed(self) -> int:
        # One draw from the loader's generator or the global RNG, exactly as iter(DataLoader) draws its
        # base seed, so a prepared stream consumes the RNG as the plain loader does.
        generator = self.base_loader.generator
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())

    def _items(self, start: dict[str, Any]) -> Iterator[tuple[Any, StreamItem]]:
        """The pass's (batch, item) pairs in round-robin worker order, from `start` on."""
        loader = self.base_loader
        if hasattr(loader.dataset, "set_epoch"):
            loader.dataset.set_epoch(self.position.epoch)  # before the workers copy it
        self._pass = start
        starts = dict(enumerate(start["workers"]))
        wrapper = RankStream(loader.dataset, self.layout, loader.collate_fn, starts, self._replays,
                             start["base_seed"])
        workers = loader.num_workers
        if not workers and not loader.pin_memory:
            # In this process, without torch's loader around it: its per-batch layers cost more than we do.
            return _one_stream(iter(wrapper), start)
        extra: dict[str, Any] = {}
        if workers:
            extra = dict(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
        generator = torch.Generator()
        generator.manual_seed(mix_seed(start["base_seed"], -1))  # never the global RNG
        inner = DataLoader(wrapper, batch_size=None, collate_fn=keep_as_is, num_workers=workers,
                           pin_memory=loader.pin_memory, timeout=loader.timeout, generator=generator,
                           worker_init_fn=functools.partial(init_worker, loader.worker_init_fn), **extra)
        return _round_robin(iter(inner), start) if workers > 1 else _one_stream(iter(inner), start)

    def _emit_stream(self, items: Iterator[tuple[Any, StreamItem]], skip: int) -> Iterator[Any]:
        """Yields batches one behind the stream, so the last is known (`end_of_dataloader`)."""
        position = self.position
        flags = self.gradient_state.begin_pass(self)
        try:
            current = next(items, None)
            going = self._agreed(current is not None)
            index = skip
            while going:
                following = next(items, None)
                going = self._agreed(following is not None)
                if not going and following is not None:
                    warnings.warn("A stream that shards itself by rank ran out on another rank first: this rank stops "
                                  "with batches left unused, so that every rank takes the same number of steps.",
                                  stacklevel=2)
                batch, item = current
                self._record(item)
                index += 1
                position.batches_consumed = index
                flags.end_of_dataloader, flags.remainder = not going, item.remainder
                yield send_to_device(batch, self.device, self._non_blocking) if self._moves_batches else batch
                current = following
            position.begin_epoch(position.epoch + 1)
            self._pass = _fresh_pass(self._workers)
        finally:
            self.gradient_state.end_pass(flags)  # an enclosing pass's flags count again

    def _agreed(self, have: bool) -> bool:
        return have if self._agree is None else self._agree(have)

    def _record(self, item: StreamItem) -> None:
        """Moves the pass state past a batch the loop is about to receive."""
        workers = self._pass["workers"]
        # In place (state_dict's readers copy it). `done` may already be set: the look-ahead can
        # pull past a worker's last batch first.
        worker = workers[item.worker]
        worker["rounds"], worker["dataset_state"] = item.rounds, item.dataset_state
        if len(workers) > 1:
            self._pass["next_worker"] = _next_running(workers, item.worker)


def _next_running(workers: list[dict[str, Any]], after: int) -> int:
    count = len(workers)
    for step in range(1, count + 1):
        candidate = (after + step) % count
        if not workers[candidate]["done"]:
            return candidate
    return after


def _one_stream(items: Iterator[tuple[Any, StreamItem]], start: dict[str, Any]) -> Iterator[tuple[Any, StreamItem]]:
    """The batches of a single stream (no workers, or one), until it reports `done`."""
    for batch, item in items:
        if item.done:
            start["workers"][0]["done"] = True
            return
        yield batch, item


def _round_robin(items: Iterator[tuple[Any, StreamItem]], start: dict[str, Any]) -> Iterator[tuple[Any, StreamItem]]:
    """Puts the workers' batches in round-robin order over the workers still running, starting at
    `start["next_worker"]` (a fresh pass: worker 0, the order of plain PyTorch). A resumed pass
    starts at another worker, while torch's own loader starts at worker 0: early batches wait in
    `pending` (at most about one per worker) until their worker's turn."""
    workers = start["workers"]
    pending: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    running = sum(not w["done"] for w in workers)
    turn = _next_running(workers, start["next_worker"] - 1)
    while running:
        while not pending[turn]:
            # Every worker reports `done` last, so its turn always comes before torch's loader ends.
            batch, item = next(items)
            pending[item.worker].append((batch, item))
        batch, item = pending[turn].popleft()
        if item.done:
            workers[turn]["done"] = True
            running -= 1
        else:
            yield batch, item
        turn = _next_running(workers, turn)


def _check_pass(saved: Any, workers: int) -> None:
    """Refuses a saved pass state this loader cannot continue (checked before anything is loaded)."""
    ok = (isinstance(saved, dict) and isinstance(saved.get("workers"), list)
          and isinstance(saved.get("next_worker"), int) and isinstance(saved.get("base_seed"), int))
    if not ok:
        raise ValueError(f"The saved stream state is malformed. Received: {str(saved)[:80]}")
    if len(saved["workers"]) != workers:
        raise ValueError(
            f"The saved stream state was written by a loader that read {len(saved['workers'])} worker streams, but "
            f"this loader reads {workers}. Resume with the same num_workers: each worker reads its own share of "
            "the stream.")
    for worker in saved["workers"]:
        if not (isinstance(worker, dict) and isinstance(worker.get("rounds"), int) and worker["rounds"] >= 0
                and isinstance(worker.get("done"), bool)):
            raise ValueError(f"The saved stream state of a worker is malformed. Received: {str(worker)[:80]}")
