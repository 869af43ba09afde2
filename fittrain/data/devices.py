"""Moving batches to the device and counting their samples."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


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
