"""The prepared DataLoader: sharded across processes, seeded, resumable and device-placing.

Shuffling uses a permutation drawn from (seed, epoch) instead of the global RNG, so every rank
agrees on the order, each epoch differs, and a resumed run rebuilds the exact order. Skipping the
first batches of an epoch happens on the index list: skipped batches are never loaded.

Sharding follows Accelerate's defaults: each process takes whole batches of the loader's batch
size (`split_batches=False`), and with `even_batches=True` the last round is completed with
samples from the start of the epoch so every rank takes the same number of steps.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ..sync import GradientState
from .position import DataPosition, PositionedSource
from .workers import SeededBatch, WorkerSeededDataset, init_worker, mix_seed


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
            g.manual_seed(mix_seed(seed, epoch))
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
                batch = SeededBatch(batch)
                batch.seed = mix_seed(seed, epoch, k)
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
            WorkerSeededDataset(loader.dataset) if workers > 0 else loader.dataset,
            batch_sampler=self.batch_sampler, num_workers=workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=functools.partial(init_worker, loader.worker_init_fn),
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
        self._generator.manual_seed(mix_seed(self.position.seed, self.position.epoch, -1))
        return iter(self._inner)

    def _fetch(self, skip: int) -> Iterator[Any]:
        """Loads batches in this process as torch's single-process fetcher does, without its
        per-batch profiler and iterator layers, which cost more than the rest of our loop."""
        dataset, collate = self.base_loader.dataset, self.base_loader.collate_fn
        getitems = getattr(dataset, "__getitems__", None)
        position = self.position
        for indices in self.batch_sampler.generate(skip, position.seed, position.epoch, seeded=False):
            yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])
