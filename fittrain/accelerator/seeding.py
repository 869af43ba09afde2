"""Seeding every random number generator alike: Accelerate's `set_seed` and Lightning's `seed_everything`.

DataLoader workers of the loaders fittrain prepares are seeded separately, each from the run's
generator (fittrain/data/workers.py), so that a resumed run deals the same batches.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from fittrain.accelerator.partial_state import PartialState
from fittrain.common.checks import check_bool


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seeds `random`, `numpy` and `torch` (every device) alike, for reproducible runs.

    Args:
        seed: The seed.
        device_specific: Add this process's index to the seed, so that processes draw differently.
        deterministic: Also `torch.use_deterministic_algorithms(True)` (slower, reproducible kernels).

    Raises:
        TypeError: for a seed that is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an integer. Received: seed={seed!r:.80} ({type(seed).__name__}). "
                        "Pass e.g. set_seed(42).")
    if device_specific:
        seed += PartialState().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy takes 0..2**32-1 only
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        torch.use_deterministic_algorithms(True)


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Lightning's `seed_everything`: `set_seed(seed)`, remembered in the environment variable
    `PL_GLOBAL_SEED` (which processes started from this one read), and returned.

    Args:
        seed: The seed, 0 <= seed < 2**32. None takes `PL_GLOBAL_SEED` from the environment, else 0.
        workers: Accepted for Lightning's programs. DataLoader workers of loaders that fittrain
            prepares are always seeded, each with a seed derived from the run's, for `random`,
            NumPy and torch alike (fittrain/data/workers.py), which is what Lightning's
            `workers=True` asks for.

    Raises:
        TypeError: for a seed that is not an integer, or `workers` that is not a bool.
        ValueError: for a seed outside [0, 2**32), which NumPy cannot take.
    """
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"`seed` must be an integer. Received: seed={seed!r:.80} ({type(seed).__name__}). "
                        "Pass e.g. seed_everything(42).")
    if not 0 <= seed < 2**32:
        raise ValueError(f"`seed` must be in [0, 2**32), the seeds NumPy takes. Received: seed={seed}. "
                         "Pass e.g. seed_everything(42).")
    check_bool("workers", workers, owner="seed_everything")
    set_seed(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    return seed
