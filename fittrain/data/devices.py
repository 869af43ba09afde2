"""Moving batches to the device and counting their samples."""

from __future__ import annotations

from typing import Any

import torch

from fittrain.common.nested import iter_tensors, map_tensors


def send_to_device(tensor: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | list[str] | tuple[str, ...] | None = None) -> Any:
    """Moves every tensor inside `tensor` to `device` (Accelerate's `send_to_device`).

    Walks dicts, lists, tuples, namedtuples and dataclasses; other values pass through.

    Args:
        tensor: A tensor or a nested structure of tensors.
        device: Where to move them.
        non_blocking: Copy asynchronously where the device allows it.
        skip_keys: Keys of a top-level dict whose values stay where they are.
    """
    device = device if isinstance(device, torch.device) else torch.device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)

    if skip_keys and isinstance(tensor, dict):
        skipped = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
        return type(tensor)((k, v if k in skipped else map_tensors(move, v, dataclasses=True))
                            for k, v in tensor.items())
    return map_tensors(move, tensor, dataclasses=True)


def batch_size_of(batch: Any) -> int:
    """Samples in `batch`: the first dimension of its first tensor (searching tuples, lists and
    dict values) that has samples, 1 for a 0-d tensor, 0 when it holds no tensor."""
    for tensor in iter_tensors(batch):
        size = int(tensor.shape[0]) if tensor.ndim else 1
        if size:
            return size
    return 0
