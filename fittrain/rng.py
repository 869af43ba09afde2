"""Capture and restore every RNG a training step may draw from: Python, NumPy, torch, CUDA.

States are kept as tensors and plain numbers, so a checkpoint stores them in a file that
`torch.load(weights_only=True)` reads without unpickling arbitrary objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Returns this process's RNG states as tensors and numbers."""
    version, words, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": version,
        "python_state": torch.tensor(words, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_kind": np_kind,
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts every RNG back exactly where `capture_rng_state` found it."""
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy_keys"].numpy().astype(np.uint32),
                         state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
