"""Seeding and signals in DataLoader workers: randomness that does not depend on which worker
loads a batch, and workers that outlive a preemption signal."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

_SEED_MODULUS = 2**63 - 1


def mix_seed(*values: int) -> int:
    """A deterministic seed from several integers (Python's hash of ints is not salted)."""
    return hash(tuple(values)) % _SEED_MODULUS


class SeededBatch(list):
    """A batch of indices that carries the seed its samples' randomness must use in a worker."""

    seed: int = 0


class WorkerSeededDataset(torch.utils.data.Dataset):
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


def init_worker(user_init: Any, worker_id: int) -> None:
    """Makes a worker outlive a preemption signal sent to the whole process group, so the
    Trainer can finish its step and save; the worker still exits with its parent."""
    from ..preemption import ignore_preemption_signals

    ignore_preemption_signals(worker_id)
    if user_init is not None:
        user_init(worker_id)
