"""Seeding and signals in DataLoader workers: randomness that does not depend on which worker
loads a batch, and workers that outlive a preemption signal."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fittrain.distributed.preemption import ignore_preemption_signals

_SEED_MODULUS = 2**63 - 1


def mix_seed(*values: int) -> int:
    """A deterministic seed from several integers (Python's hash of ints is not salted)."""
    return hash(tuple(values)) % _SEED_MODULUS


class SeededBatch(list):
    """A batch of indices that carries the seed its samples' randomness must use in a worker."""

    seed: int = 0


class SeededKey:
    """The key of a ready batch (`batch_size=None` loaders: `dataset[key]` is a whole batch) with
    the seed its randomness must use in a worker."""

    __slots__ = ("key", "seed")

    def __init__(self, key: Any, seed: int) -> None:
        self.key, self.seed = key, seed


def seed_worker_rngs(seed: int) -> None:
    """Seeds Python's `random`, NumPy's global RNG and torch's CPU generator in a DataLoader worker."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # The CPU generator only: torch.manual_seed also visits every accelerator backend, which costs
    # ~0.1 ms a call (per batch here), and a worker has no accelerator RNG of its own to seed.
    torch.default_generator.manual_seed(seed)


def _seed_this_worker(seed: int | None) -> None:
    if seed is not None and get_worker_info() is not None:
        seed_worker_rngs(seed)


class WorkerSeededDataset(torch.utils.data.Dataset):
    """Seeds a worker's RNGs per batch, so `__getitem__` randomness does not depend on which
    worker loads a batch, on `num_workers`, or on how many batches a resumed run skipped.

    Each batch's seed is `mix_seed(base_seed, epoch, batch number)`, where the base seed is the
    one the DataLoader draws at the start of a pass as torch does (`fittrain.data.order`).
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, SeededKey):
            _seed_this_worker(index.seed)
            return self.dataset[index.key]
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        _seed_this_worker(getattr(indices, "seed", None))
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(list(indices)) if getitems else [self.dataset[i] for i in indices]


def init_worker(user_init: Any, worker_id: int) -> None:
    """Makes a worker outlive a preemption signal sent to the whole process group, so the
    Trainer can finish its step and save; the worker still exits with its parent."""
    ignore_preemption_signals(worker_id)
    if user_init is not None:
        user_init(worker_id)
