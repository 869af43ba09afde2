"""Lightning's share of the data on each process, under fittrain's dealing of batches.

On several processes Lightning puts a `DistributedSampler` into each DataLoader: process r takes
the samples r, r + W, r + 2W, ... of the epoch's order (a permutation from a generator seeded with
`PL_GLOBAL_SEED + epoch` for a training loader, shuffled or not, and for an evaluation loader that
shuffles; the dataset's order otherwise), padded from the
start so every process has as many; `predict` takes them unpadded. fittrain deals whole batches
instead. So that each process of a ported program sees exactly Lightning's batches (and its
metrics match Lightning's rank by rank), `lightning_sharded` rebuilds such a loader around a
`RankInterleavedBatches` batch sampler, which lists every process's Lightning batches in turn:

    process 0's batch 0, process 1's batch 0, ..., process 0's batch 1, process 1's batch 1, ...

fittrain's dealer gives batch k to process k % W, so process r loads exactly its Lightning batches.
Every process computes the same list (no random state is shared), the epoch comes from
`set_epoch` at each epoch start (`DistributedSampling`), and nothing in it draws from the global
RNG. Each process's global RNG advances as under Lightning, where every process's DataLoader
iterator draws its base seed: fittrain draws it on process 0 only (the others draw from its state
and restore theirs), so `DistributedSampling` draws one on each other process when a loop starts
(random numbers a training_step draws, such as a GAN's noise, then match Lightning's). Loaders with another sampler, an
IterableDataset, or a single process are left as they are (fittrain's own dealing).
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from fittrain.trainer.events import Callback as NativeCallback


class RankInterleavedBatches:
    """A batch sampler listing each process's Lightning batches in turn (see the module docstring).

    Args:
        length: The dataset's length.
        batch_size: The loader's batch size.
        drop_last: The loader's drop_last (each process drops its own incomplete last batch).
        num_replicas: The number of processes.
        shuffle: Permute the samples each epoch (from `seed + epoch`).
        seed: Lightning's seed (`PL_GLOBAL_SEED`, else 0).
        pad: Pad every process to the same number of samples (DistributedSampler); False for predict.
    """

    def __init__(self, length: int, batch_size: int, drop_last: bool, num_replicas: int, shuffle: bool, seed: int,
                 pad: bool) -> None:
        self.length, self.batch_size, self.drop_last = length, batch_size, drop_last
        self.num_replicas, self.shuffle, self.seed, self.pad = num_replicas, shuffle, seed, pad
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's permutation (Lightning calls the sampler's set_epoch at each epoch start)."""
        self.epoch = epoch

    def indices_of(self, rank: int) -> list[int]:
        """Process `rank`'s samples of the current epoch, as DistributedSampler gives them."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        if self.pad:
            total = math.ceil(self.length / self.num_replicas) * self.num_replicas
            order += (order * math.ceil(total / max(len(order), 1)))[:total - len(order)]
        return order[rank::self.num_replicas]

    def batches_of(self, rank: int) -> list[list[int]]:
        """Process `rank`'s batches of the current epoch."""
        indices = self.indices_of(rank)
        batches = [indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = [self.batches_of(rank) for rank in range(self.num_replicas)]
        for round_ in range(max(len(batches) for batches in per_rank)):
            for batches in per_rank:
                if round_ < len(batches):  # predict: later processes may have one batch fewer
                    yield batches[round_]

    def __len__(self) -> int:
        return sum(len(self.batches_of(rank)) for rank in range(self.num_replicas))


def lightning_sharded(loader: Any, num_replicas: int, stage: str, overfit: bool = False) -> Any:
    """`loader` rebuilt so that fittrain's dealing gives each process Lightning's batches; any other
    loader (see the module docstring) as it is.

    Args:
        loader: The loader a stage runs on.
        num_replicas: The number of processes.
        stage: "train" (Lightning always shuffles a training loader it shards), "eval" (shuffled when the
            loader is) or "predict" (the loader's order, unpadded).
        overfit: `overfit_batches` is on: Lightning does not shuffle then.
    """
    if num_replicas < 2 or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    sampler = loader.sampler
    if loader.batch_size is None or not isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return loader
    predicting = stage == "predict"
    if isinstance(sampler, DistributedSampler):  # the program's own: Lightning keeps it
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, loader.drop_last or sampler.drop_last
    else:
        shuffle = (stage == "train" or isinstance(sampler, RandomSampler)) and not overfit and not predicting
        seed, drop_last = int(os.environ.get("PL_GLOBAL_SEED", 0)), loader.drop_last
    batches = RankInterleavedBatches(len(loader.dataset), loader.batch_size, drop_last, num_replicas, shuffle, seed,
                                     pad=not predicting)
    workers = loader.num_workers
    extra = dict(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                 multiprocessing_context=loader.multiprocessing_context) if workers > 0 else {}
    return DataLoader(loader.dataset, batch_sampler=batches, num_workers=workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      generator=loader.generator, **extra)


def real_batches(loader: Any, rank: int) -> int | None:
    """How many batches of `loader` are process `rank`'s own (the rest pad the last round), or None."""
    batches = getattr(loader, "batch_sampler", None)
    return len(batches.batches_of(rank)) if isinstance(batches, RankInterleavedBatches) else None


def _sharded_base(loader: Any) -> Any:
    """The Lightning-sharded DataLoader under a prepared `loader`, or None."""
    base = getattr(loader, "base_loader", loader)
    return base if isinstance(getattr(base, "batch_sampler", None), RankInterleavedBatches) else None


class DistributedSampling(NativeCallback):
    """Lightning's per-epoch sampler epoch and per-process base-seed draws for sharded loaders (see the
    module docstring); acts at loop starts only, never per batch."""

    def on_train_epoch_start(self, trainer: Any) -> None:
        base = _sharded_base(trainer.train_loader)
        if base is not None:
            trainer.train_loader.set_epoch(trainer.state.epoch)  # reaches RankInterleavedBatches.set_epoch
            if not trainer.train_loader.position.batches_consumed:  # a resumed epoch drew when it started
                self._draw(trainer, base)

    def on_validation_start(self, trainer: Any) -> None:
        self._draw(trainer, _sharded_base(trainer.val_loader))

    def on_test_start(self, trainer: Any) -> None:
        self._draw(trainer, _sharded_base(getattr(trainer.data, "last_loader", None)))

    def on_predict_start(self, trainer: Any) -> None:
        self._draw(trainer, _sharded_base(getattr(trainer.data, "last_loader", None)))

    @staticmethod
    def _draw(trainer: Any, base: Any) -> None:
        if base is not None and base.generator is None and not trainer.accelerator.is_main_process:
            torch.empty((), dtype=torch.int64).random_()  # the base seed this process's iterator draws in Lightning
