"""The prepared DataLoader over a map-style dataset: sharded, resumable, device-placing, in the user's order.

Every kind of map-style DataLoader is accepted: `batch_size=` (with `shuffle`, a `sampler` or a
`generator`), a custom `batch_sampler`, and `batch_size=None`, whose sampler yields keys and
`dataset[key]` is a ready batch (`collate_fn` applies per item, as in torch). A torchdata
`StatefulDataLoader` is a DataLoader too: it is rebuilt like any other, and this loader's
`state_dict()` (which checkpoints save) supersedes its own, which is neither saved nor read.

Order: the user's sampler and generator decide it, as in plain PyTorch (Accelerate's default
`use_seedable_sampler=False`). On one process a prepared loader yields the same batches as the
plain one from the same RNG state, and consumes the global RNG as it does. Several processes
draw the same order from rank 0's RNG state and deal it out; `order.EpochOrder` explains how,
and how a resumed epoch replays its order.

Dealing (`dealing`): with `batch_size`, each process takes whole batches of that size, and with
`even_batches=True` the last round is completed with samples from the start of the epoch. With a
`batch_sampler` or `batch_size=None`, batch k of the epoch goes to rank k % num_processes, and
the last round is completed with whole batches from the start. `split_batches=True` needs
`batch_size` (a ready batch cannot be split). Skipping the first batches of an epoch happens on
the index list: skipped batches are never loaded.

Another number of processes: the state counts the samples (batches, for a `batch_sampler` or
`batch_size=None`) of the epoch's order that all processes consumed. A state saved by N processes
and loaded on M replays the epoch's order and deals its rest to the M processes (`dealing`);
later epochs are dealt as any M-process run deals them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from fittrain.common.checks import is_int
from fittrain.common.reprs import short_repr
from fittrain.data.dealing import BatchDealer, SampleDealer
from fittrain.data.order import EpochOrder, draws_randomly
from fittrain.data.position import DataPosition, PositionedSource
from fittrain.data.workers import SeededBatch, SeededKey, WorkerSeededDataset, init_worker, mix_seed
from fittrain.distributed.gradient_state import GradientState


class _PassBatches:
    """This rank's batches (or keys) of the current pass, for the worker DataLoader to load.

    Set before every pass; iterating twice gives the same items (a worker DataLoader calls
    iter() twice while starting up).
    """

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


def _epoch_length(loader: DataLoader, name: str) -> int:
    """len() of the loader's sampler or batch sampler (`name`), which sharding and resuming need."""
    part = getattr(loader, name)
    try:
        return len(part)
    except TypeError:
        unit = "batches" if name == "batch_sampler" or loader.batch_size is None else "samples"
        raise TypeError(
            f"prepare() needs to know how many {unit} an epoch has, to deal them to processes and resume "
            f"mid-epoch. Received a DataLoader whose `{name}` ({type(part).__name__}) has no len(). Give "
            f"{type(part).__name__} a __len__, or use an IterableDataset for a stream without one.") from None


def _check_loader(loader: DataLoader, num_processes: int, split_batches: bool) -> str:
    """What kind of map-style loader this is: "samples" (batch_size), "batches" (batch_sampler)
    or "keys" (batch_size=None); raises a clear error for one that cannot be prepared."""
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            "DataLoaderShard takes DataLoaders over map-style datasets (with __getitem__). Received one over "
            f"{type(loader.dataset).__name__}, an IterableDataset: pass it to Accelerator.prepare(), which "
            "prepares streams separately.")
    mode = "samples" if loader.batch_size is not None else "batches" if loader.batch_sampler is not None else "keys"
    if split_batches and mode != "samples":
        what = (f"batch_sampler={type(loader.batch_sampler).__name__}" if mode == "batches"
                else "batch_size=None (each dataset item is a ready batch)")
        raise ValueError(
            f"`split_batches=True` cannot split ready batches across processes. Received a DataLoader with {what}. "
            "Use split_batches=False (each process then takes whole batches), or build the DataLoader with "
            "batch_size=... so each batch can be split.")
    if split_batches and loader.batch_size % num_processes:
        raise ValueError(
            f"`split_batches=True` needs the loader's batch_size to divide by the {num_processes} processes. "
            f"Received: batch_size={loader.batch_size}. Use a multiple of {num_processes}.")
    return mode


def _index_lists(batches: list[Any]) -> list[Any]:
    """The batch sampler's batches as lists of indices; anything else is a clear error."""
    for k, batch in enumerate(batches):
        if type(batch) is list:
            continue
        if isinstance(batch, tuple) or (isinstance(batch, (torch.Tensor, np.ndarray)) and batch.ndim == 1):
            batches[k] = list(batch) if isinstance(batch, tuple) else batch.tolist()
            continue
        raise TypeError(
            f"`batch_sampler` must yield lists of dataset indices, one list per batch. Received {short_repr(batch)} "
            f"({type(batch).__name__}) as batch {k} of the epoch. Make its __iter__ yield lists such as [3, 1, 4]; "
            "for a dataset whose items are whole batches, use batch_size=None with a sampler of keys instead.")
    return batches


class DataLoaderShard(PositionedSource):
    """A prepared DataLoader: this rank's batches, on the device, in a resumable order.

    Iterating it runs one epoch. A pass that finishes advances `position.epoch`; `state_dict()`
    records the position and the random state the epoch's order came from, so a resumed run
    continues the epoch exactly with `skip_first_batches`.

    Args:
        loader: The user's DataLoader; its dataset, sampler, batch sampler, generator, collate_fn,
            workers and batch size are kept.
        device: Where batches go, or None to leave them where the loader made them.
        gradient_state: The owning Accelerator's accumulation state (`end_of_dataloader`).
        num_processes: World size.
        process_index: This rank.
        split_batches: Split each batch across ranks instead of giving each rank whole batches.
        even_batches: Pad the last round so every rank takes the same number of steps.
        share: Returns rank 0's object on every rank (a broadcast), so all ranks draw one order;
            None when each rank's own RNG is already the same (tests that shard by hand).
    """

    def __init__(self, loader: DataLoader, device: torch.device | None, gradient_state: GradientState,
                 num_processes: int = 1, process_index: int = 0, split_batches: bool = False,
                 even_batches: bool = True, share: Callable[[Any], Any] | None = None) -> None:
        mode = _check_loader(loader, num_processes, split_batches)
        self.base_loader = loader
        self.device = device
        self.gradient_state = gradient_state
        self.position = DataPosition()
        self.num_processes = num_processes
        self._mode = mode
        self._unit = "samples" if mode == "samples" else "batches"
        # Items in the order of the pass last drawn (for `order_consumed`); None until one is drawn
        # after a load, when the loaded count stands.
        self._pass_items: int | None = None
        self._loaded_consumed: int | None = None
        if mode == "samples":
            self.dealer: SampleDealer | BatchDealer = SampleDealer(
                _epoch_length(loader, "sampler"), loader.batch_size, loader.drop_last, num_processes,
                process_index, split_batches, even_batches)
        else:
            declared = _epoch_length(loader, "batch_sampler" if mode == "batches" else "sampler")
            self.dealer = BatchDealer(declared, num_processes, process_index, even_batches, sized=mode == "batches")
        shares = share is not None and num_processes > 1 and draws_randomly(loader)
        self.order = EpochOrder(loader, share if shares else None, process_index == 0)
        self._pass = _PassBatches()
        self._generator = torch.Generator()
        self._inner = self._build_inner(loader)
        # Moving a batch costs a recursive walk; on the CPU the batch is already where it belongs.
        self._moves_batches = device is not None and device.type != "cpu"
        self._fetches_directly = loader.num_workers == 0 and not loader.pin_memory
        self._non_blocking = bool(loader.pin_memory)

    def _build_inner(self, loader: DataLoader) -> DataLoader:
        workers = loader.num_workers
        kwargs: dict[str, Any] = {}
        if workers > 0:
            kwargs = dict(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                          multiprocessing_context=loader.multiprocessing_context)
        if self._mode == "keys":
            kwargs.update(batch_size=None, sampler=self._pass)
        else:
            kwargs.update(batch_sampler=self._pass)
        # The worker base seed comes from our own generator, never the global RNG, which the
        # pass has already drawn from exactly as the plain DataLoader would.
        return DataLoader(
            WorkerSeededDataset(loader.dataset) if workers > 0 else loader.dataset, num_workers=workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=functools.partial(init_worker, loader.worker_init_fn), generator=self._generator, **kwargs)

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        return self.base_loader.dataset

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this process (None when batches are ready-made: batch_size=None)."""
        if isinstance(self.dealer, SampleDealer):
            return self.dealer.batch_size
        return getattr(self.base_loader.batch_sampler, "batch_size", None)

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step summed over all processes (None when unknown before loading)."""
        if isinstance(self.dealer, SampleDealer):
            return self.dealer.round_size
        size = self.batch_size
        return size * self.num_processes if isinstance(size, int) else None

    @property
    def total_dataset_length(self) -> int:
        """Samples in one epoch before padding (batches, for a batch_sampler or batch_size=None)."""
        return self.dealer.declared

    @property
    def length_check(self) -> tuple[int, str]:
        """What every process must agree on at prepare(): the epoch's length, and its unit."""
        return self.dealer.declared, "samples" if self._mode == "samples" else "batches"

    @property
    def batch_sampler(self) -> Any:
        """The user's batch sampler (None for `batch_size=None`): its `.sampler` is the user's sampler."""
        return self.base_loader.batch_sampler

    @property
    def sampler(self) -> "DataLoaderShard":
        # Scripts written for DDP call `loader.sampler.set_epoch(e)`; route that to us.
        return self

    def set_epoch(self, epoch: int) -> None:
        """Numbers the epoch, and passes it on to the user's sampler and batch sampler that have
        set_epoch (samplers that seed their order from the epoch)."""
        super().set_epoch(epoch)
        loader = self.base_loader
        for part in {id(p): p for p in (loader.sampler, loader.batch_sampler) if p is not None}.values():
            if callable(getattr(part, "set_epoch", None)):
                part.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dealer)

    def batches_left(self, skip: int) -> int:
        """Batches that a pass of the current epoch from batch `skip` yields on this rank (after a
        resume on another number of processes, the re-dealt rest of the epoch)."""
        position = self.position
        start, first = (position.start_items, position.start_batch) if skip and position.start_batch else (0, 0)
        return max(first + self.dealer.count(self.dealer.declared, start) - skip, 0)

    def _items_per_round(self) -> int:
        return self.dealer.round_size if isinstance(self.dealer, SampleDealer) else self.num_processes

    def _epoch_items(self) -> int:
        return self.dealer.declared

    def _order_consumed(self) -> int | None:
        position = self.position
        taken = position.batches_consumed - position.start_batch
        if taken <= 0:
            return position.start_items
        if self._pass_items is not None:
            return self.dealer.consumed(taken, self._pass_items, position.start_items)
        if self._loaded_consumed is not None:  # loaded, and no pass drawn since
            return self._loaded_consumed
        # A state from before the count was saved: the order's length is the declared one.
        return self.dealer.consumed(taken, self.dealer.declared, position.start_items)

    def iterate(self, skip: int) -> Iterator[Any]:
        """Runs the current epoch from batch `skip` on, without loading the skipped batches.

        The order is drawn when the first batch is requested, as torch draws it; a pass with
        skip > 0 replays the order its epoch was drawn with, when this loader knows it. After a
        resume on another number of processes, the pass deals the rest of the epoch's order from
        batch `position.start_batch` on (`PositionedSource._pass_start`).
        """
        self.sync_rng()
        start, first = self._pass_start(skip)
        epoch = self.position.epoch
        base_seed, order = self.order.draw(epoch, replay=skip > 0)
        if self._mode == "batches":
            order = _index_lists(order)
        elif self._mode == "samples":
            order = self.dealer.flatten(order)
        self._pass_items = len(order)
        dealt = self.dealer.deal(order, skip - first, start)
        remainder, real_ranks = self.dealer.padding(order, start)
        batches = self._fetch(dealt) if self._fetches_directly else self._start_inner(dealt, base_seed, epoch)
        yield from self._emit(batches, skip, first + self.dealer.count(len(order), start), remainder, real_ranks)

    def _start_inner(self, dealt: Iterator[tuple[int, Any]], base_seed: int, epoch: int) -> Iterator[Any]:
        seeded = self.base_loader.num_workers > 0
        items: list[Any] = []
        for number, item in dealt:
            seed = mix_seed(base_seed, epoch, number) if seeded else 0
            if self._mode == "keys":
                items.append(SeededKey(item, seed) if seeded else item)
            else:
                items.append(SeededBatch(item))
                items[-1].seed = seed
        self._pass.items = items
        self._generator.manual_seed(base_seed)
        return iter(self._inner)

    def _fetch(self, dealt: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        """Loads batches in this process as torch's single-process fetcher does, without its
        per-batch profiler and iterator layers, which cost more than the rest of our loop."""
        dataset, collate = self.base_loader.dataset, self.base_loader.collate_fn
        if self._mode == "keys":
            for _, key in dealt:
                yield collate(dataset[key])
            return
        getitems = getattr(dataset, "__getitems__", None)
        for _, indices in dealt:
            yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        """The data position (with `order_consumed`, in samples or batches) plus "order": the random
        state the current epoch's order was drawn from (tensors and ints; None before the first pass)."""
        return dict(super().state_dict(), order=self.order.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position and the order's random state. It never skips by itself: pass
        `batches_consumed` to `skip_first_batches`, which then replays the epoch's order (a state
        of another number of processes: its rest, dealt to this run's processes)."""
        loaded = self._position_from(state)  # both checked first: raise before anything changes
        self.order.load_state_dict(state.get("order"))
        self._set_position(loaded)
        consumed = state.get("order_consumed")
        self._pass_items = None
        self._loaded_consumed = consumed if is_int(consumed) else None
