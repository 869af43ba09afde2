"""`Trainer(deterministic=...)`: torch's deterministic algorithms, switched as Lightning switches them.

- None (the default): nothing is changed.
- True: `torch.use_deterministic_algorithms(True)`: an operation without a deterministic
  implementation raises. cuDNN's benchmark mode (which picks algorithms by timing them) is turned
  off, and `CUBLAS_WORKSPACE_CONFIG=":4096:8"` is set, which deterministic cuBLAS needs on CUDA 10.2+.
- "warn": the same, but such an operation warns instead of raising (`warn_only=True`).
- False: `torch.use_deterministic_algorithms(False)`.

These are settings of the whole process, made when the Trainer is built, as in Lightning.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fittrain.common.checks import check_choice


def use_deterministic(value: Any) -> bool | str | None:
    """Applies `deterministic` (see the module docstring) and returns it.

    Raises:
        ValueError: for anything but None, True, False or "warn".
    """
    check_choice("deterministic", value, (None, True, False, "warn"), owner="Trainer", fix=(
        'Pass True to raise on nondeterministic operations, "warn" to warn on them, or None to leave torch as it is.'))
    if value is None:
        return None
    if value:
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(bool(value), warn_only=value == "warn")
    return value
