"""Accelerate's `use_seedable_sampler=True`: a shuffled order that depends on a seed and the epoch only.

By default a prepared loader keeps the user's order, drawn from the loader's generator or the
global RNG (`fittrain.data.order`). With `DataLoaderConfiguration(use_seedable_sampler=True)` a
loader that shuffles with torch's `RandomSampler` draws epoch e's order from `data_seed + e`
instead, as Accelerate's `SeedableRandomSampler` does: the same order on any number of
processes, whatever else consumed the global RNG, and again after a resume.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler


class SeedableRandomSampler(RandomSampler):
    """A `RandomSampler` whose epoch e yields the permutation drawn from `initial_seed + e`
    (Accelerate's class of the same name, with the same arguments).

    Args:
        data_source, replacement, num_samples, generator: As `RandomSampler` takes them; the
            generator (a new one when None) is reseeded at every pass.
        data_seed: The seed of epoch 0; None takes torch's initial seed (`torch.initial_seed()`).

    A full pass moves it to the next epoch by itself, so a plain loop over it shuffles anew each
    epoch; the prepared loader also sets the epoch before each pass, so a resumed run redraws it.
    """

    def __init__(self, data_source: Any, replacement: bool = False, num_samples: int | None = None,
                 generator: torch.Generator | None = None, data_seed: int | None = None) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples,
                         generator=generator if generator is not None else torch.Generator())
        self.initial_seed = torch.initial_seed() if data_seed is None else data_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the order of `epoch` (the prepared loader calls it before each pass)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def with_seedable_sampler(loader: DataLoader, data_seed: int | None) -> DataLoader:
    """`loader` with its `RandomSampler` replaced by a `SeedableRandomSampler` (the same loader
    otherwise); a loader without a RandomSampler, or with a batch sampler of the user's own, is
    returned as it is.

    Args:
        loader: The user's DataLoader.
        data_seed: The seed of epoch 0; None takes torch's initial seed (`torch.initial_seed()`).
    """
    sampler = loader.sampler
    custom_batches = loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
    if type(sampler) is not RandomSampler or custom_batches:
        return loader
    seedable = SeedableRandomSampler(loader.dataset, sampler.replacement, sampler._num_samples, data_seed=data_seed)
    batching: dict[str, Any] = {"batch_size": None, "sampler": seedable}
    if loader.batch_sampler is not None:
        batching = {"batch_sampler": BatchSampler(seedable, loader.batch_size, loader.drop_last)}
    extra: dict[str, Any] = {}
    if loader.num_workers > 0:
        extra = dict(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    return DataLoader(loader.dataset, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                      **batching, **extra)


def seedable_samplers(loader: DataLoader) -> list[SeedableRandomSampler]:
    """The SeedableRandomSamplers `loader` draws from (none, or one)."""
    parts = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    return [part for part in parts if isinstance(part, SeedableRandomSampler)][:1]
