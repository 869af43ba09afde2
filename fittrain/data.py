"""The prepared DataLoader: sharded across processes, seeded, resumable and device-placing.

Shuffling uses a permutation drawn from (seed, epoch) instead of the global RNG, so every rank
agrees on the order, each epoch differs, and a resumed run rebuilds the exact order. Skipping the
first batches of an epoch happens on the index list: skipped batches are never loaded.

Sharding follows Accelerate's defaults: each process takes whole batches of the loader's batch
size (`split_batches=False`), and with `even_batches=True` the last round is completed with
samples from the start of the epoch so every rank takes the same number of steps.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, get_worker_info

from .sync import GradientState

_SEED_MODULUS = 2**63 - 1


def send_to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Moves every tensor inside `obj` to `device`.

    Walks dicts, lists, tuples, namedtuples and dataclasses; other values pass through.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return type(obj)((k, send_to_device(v, device, non_blocking)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(send_to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: send_to_device(getattr(obj, f.name), device, non_blocking)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def batch_size_of(batch: Any) -> int:
    """Samples in `batch`: the first dimension of its first tensor (searching tuples, lists and
    dict values), 1 for a 0-d tensor, 0 when it holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 0


def _mix(*values: int) -> int:
    """A deterministic seed from several integers (Python's hash of ints is not salted)."""
    return hash(tuple(values)) % _SEED_MODULUS


class _SeededBatch(list):
    """A batch of indices that carries the seed its samples' randomness must use in a worker."""

    seed: int = 0


class _WorkerSeededDataset(torch.utils.data.Dataset):
    """Seeds a worker's RNGs per batch, so `__getitem__` randomness does not depend on which
    worker loads a batch, on `num_workers`, or on how many batches a resumed run skipped."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is not None and get_worker_info() is not None:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]


def _init_worker(user_init: Any, worker_id: int) -> None:
    """Makes a worker outlive a preemption signal sent to the whole process group, so the
    Trainer can finish its step and save; the worker still exits with its parent."""
    from .preemption import ignore_preemption_signals

    ignore_preemption_signals(worker_id)
    if user_init is not None:
        user_init(worker_id)


@dataclasses.dataclass
class DataPosition:
    """Where a prepared loader stands: enough to rebuild an epoch's order and continue it.

    Attributes:
        seed: Seed of the shuffle permutation (the same on every rank).
        epoch: Completed passes; the next pass uses permutation (seed, epoch).
        batches_consumed: Batches of the current epoch already handed out on this rank.
    """

    seed: int = 0
    epoch: int = 0
    batches_consumed: int = 0


class PositionedSource:
    """What every prepared data source shares: a `DataPosition`, saved and restored by checkpoints,
    and the per-batch bookkeeping of an epoch (`_emit`)."""

    position: DataPosition
    gradient_state: GradientState
    device: torch.device | None
    _moves_batches: bool = False
    _non_blocking: bool = False

    def _emit(self, batches: Iterator[Any], skip: int, total: int, remainder: int = 0) -> Iterator[Any]:
        """Yields this epoch's batches `skip`..`total - 1` from `batches`, on the device, keeping the
        position and the accumulation state (`end_of_dataloader`, `remainder`) up to date."""
        state, position = self.gradient_state, self.position
        state.end_of_dataloader, state.remainder = False, remainder
        last = total - 1
        for index, batch in zip(range(skip, total), batches):  # range first: no batch is pulled past the end
            position.batches_consumed = index + 1
            state.end_of_dataloader = index == last
            yield send_to_device(batch, self.device, self._non_blocking) if self._moves_batches else batch
        position.epoch += 1
        position.batches_consumed = 0
        # The pass is over: like Accelerate, code after the loop is no longer "in the last batch".
        state.end_of_dataloader, state.remainder = False, 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of `epoch`, for loops that number their epochs themselves."""
        if epoch != self.position.epoch:
            self.position.epoch, self.position.batches_consumed = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """The data position: shuffle seed, epoch and batches consumed (JSON-safe)."""
        return dataclasses.asdict(self.position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores the position. It never skips by itself: pass `batches_consumed` to
        `skip_first_batches` to continue a half-finished epoch."""
        self.position.seed = int(state["seed"])
        self.position.epoch = int(state["epoch"])
        self.position.batches_consumed = int(state["batches_consumed"])


class _ShardedBatchSampler:
    """Yields this rank's batches of indices for one epoch, starting after `skip` batches."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, shuffle: bool, num_processes: int,
                 process_index: int, split_batches: bool, even_batches: bool, position: DataPosition) -> None:
        self.sampler, self.drop_last, self.shuffle = sampler, drop_last, shuffle
        self.num_processes, self.process_index = num_processes, process_index
        self.even_batches, self.position = even_batches, position
        # Per-process batch size: the loader's, or its share of it when batches are split.
        self.batch_size = batch_size // num_processes if split_batches else batch_size
        self.round_size = self.batch_size * num_processes
        self.skip = 0

    def _indices(self, seed: int, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_mix(seed, epoch))
            return torch.randperm(len(self.sampler), generator=g).tolist()
        return list(self.sampler)

    def _rounds(self, n: int) -> int:
        full, rest = divmod(n, self.round_size)
        return full if (rest == 0 or self.drop_last) else full + 1

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        n = len(self.sampler)
        rounds = self._rounds(n)
        rest = n % self.round_size
        if self.even_batches or self.drop_last or rest == 0:
            return rounds
        # Uneven tail: ranks past the remaining samples get no last batch.
        return rounds - 1 + (1 if rest > self.process_index * self.batch_size else 0)

    @property
    def _pads(self) -> bool:
        # One process has no peer to keep in step with, so its last batch stays short, as in
        # plain PyTorch (and Accelerate, which does not shard a single process's loader).
        return self.even_batches and self.num_processes > 1

    def _batch(self, indices: list[int], k: int) -> list[int]:
        chunk = indices[k * self.round_size:(k + 1) * self.round_size]
        if self._pads and len(chunk) < self.round_size:
            # Complete the last round from the start of the epoch, as Accelerate does, so every
            # rank takes the same number of steps; gather_for_metrics drops these repeats.
            chunk = chunk + [indices[i % len(indices)] for i in range(self.round_size - len(chunk))]
        start = self.process_index * self.batch_size
        return chunk[start:start + self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        # Capture skip and position now: DataLoader calls iter() eagerly but pulls batches later.
        # `skip` is not reset here: a worker DataLoader calls iter() twice while starting up, and
        # the second call must skip too. `DataLoaderShard.iterate` sets it before every pass.
        return self.generate(self.skip, self.position.seed, self.position.epoch, seeded=True)

    def generate(self, skip: int, seed: int, epoch: int, seeded: bool) -> Iterator[list[int]]:
        """The index batches of epoch `epoch` from batch `skip` on; `seeded` ones carry the seed a
        worker reseeds its RNGs with (only workers need it)."""
        indices = self._indices(seed, epoch)
        for k in range(skip, len(self)):
            batch = self._batch(indices, k)
            if seeded:
                batch = _SeededBatch(batch)
                batch.seed = _mix(seed, epoch, k)
            yield batch

    def padded_remainder(self) -> int:
        """Real samples in the last round when padding completed it, else 0 (nothing to drop)."""
        rest = len(self.sampler) % self.round_size
        return rest if (rest and self._pads and not self.drop_last) else 0


def _is_default_shuffle(sampler: Any) -> bool:
    """A plain `shuffle=True` sampler, which we may replace with a seeded permutation."""
    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def _draw_seed(sampler: Any) -> int:
    """The epoch-0 shuffle seed, drawn once at prepare() from the sampler's generator or the
    global torch RNG, so `torch.manual_seed` before prepare() fixes the whole run's order."""
    generator = getattr(sampler, "generator", None)
    return int(torch.randint(0, 2**62, (), generator=generator).item())


class DataLoaderShard(PositionedSource):
    """A prepared DataLoader: this rank's batches, on the device, in a resumable order.

    Iterating it runs one epoch. A pass that finishes advances `position.epoch`, so the next
    pass reshuffles; `state_dict()` records the position, and `skip_first_batches` continues it.

    Args:
        loader: The user's DataLoader; its dataset, collate_fn, workers and batch size are kept.
        device: Where batches go, or None to leave them where the loader made them.
        gradient_state: The owning Accelerator's accumulation state (`end_of_dataloader`).
        num_processes: World size.
        process_index: This rank.
        split_batches: Split each batch across ranks instead of giving each rank whole batches.
        even_batches: Pad the last round so every rank takes the same number of steps.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None, gradient_state: GradientState,
                 num_processes: int = 1, process_index: int = 0, split_batches: bool = False,
                 even_batches: bool = True) -> None:
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError(
                "prepare() supports map-style datasets (with __len__ and __getitem__). Received a DataLoader "
                f"over {type(loader.dataset).__name__}, an IterableDataset; shard it yourself per rank and "
                "pass the DataLoader unprepared."
            )
        if loader.batch_size is None:
            raise TypeError(
                "prepare() needs a DataLoader built with batch_size (and optionally shuffle/sampler); "
                "Received one built with a custom batch_sampler. Pass batch_size=... instead."
            )
        if split_batches and loader.batch_size % num_processes:
            raise ValueError(
                f"`split_batches=True` needs the loader's batch_size to divide by the {num_processes} processes. "
                f"Received: batch_size={loader.batch_size}. Use a multiple of {num_processes}."
            )
        self.base_loader = loader
        self.device = device
        self.gradient_state = gradient_state
        shuffle = _is_default_shuffle(loader.sampler)
        self.position = DataPosition(seed=_draw_seed(loader.sampler) if shuffle else 0)
        self.batch_sampler = _ShardedBatchSampler(
            loader.sampler, loader.batch_size, loader.drop_last, shuffle, num_processes, process_index,
            split_batches, even_batches, self.position)
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
        return DataLoader(
            _WorkerSeededDataset(loader.dataset) if workers > 0 else loader.dataset,
            batch_sampler=self.batch_sampler, num_workers=workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=functools.partial(_init_worker, loader.worker_init_fn),
            generator=self._generator, **kwargs)

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        return self.base_loader.dataset

    @property
    def batch_size(self) -> int:
        """Samples per batch on this process."""
        return self.batch_sampler.batch_size

    @property
    def total_batch_size(self) -> int:
        """Samples per step summed over all processes."""
        return self.batch_sampler.round_size

    @property
    def total_dataset_length(self) -> int:
        """Samples in one epoch of the dataset, before padding."""
        return len(self.batch_sampler.sampler)

    @property
    def sampler(self) -> "DataLoaderShard":
        # Scripts written for DDP call `loader.sampler.set_epoch(e)`; route that to us.
        return self

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(skip=0)

    def iterate(self, skip: int) -> Iterator[Any]:
        """Runs the current epoch from batch `skip` on, without loading the skipped batches."""
        self.batch_sampler.skip = skip
        iterator = self._fetch(skip) if self._fetches_directly else self._start_inner()
        yield from self._emit(iterator, skip, len(self.batch_sampler), self.batch_sampler.padded_remainder())

    def _start_inner(self) -> Iterator[Any]:
        # The worker base seed comes from our own generator, not the global RNG, so creating the
        # iterator leaves the global stream exactly where a resumed run restored it.
        self._generator.manual_seed(_mix(self.position.seed, self.position.epoch, -1))
        return iter(self._inner)

    def _fetch(self, skip: int) -> Iterator[Any]:
        """Loads batches in this process as torch's single-process fetcher does, without its
        per-batch profiler and iterator layers, which cost more than the rest of our loop."""
        dataset, collate = self.base_loader.dataset, self.base_loader.collate_fn
        getitems = getattr(dataset, "__getitems__", None)
        position = self.position
        for indices in self.batch_sampler.generate(skip, position.seed, position.epoch, seeded=False):
            yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])


class SkippedDataLoader:
    """One pass of a prepared loader that starts after its first `num_batches` batches.

    It shares the loader's position, so after this pass the loader continues with the next epoch.
    """

    def __init__(self, loader: DataLoaderShard, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self) -> Iterator[Any]:
        return self.loader.iterate(skip=self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
