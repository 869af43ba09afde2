"""Gradient norms and clipping over plain tensors and DTensors on any number of device meshes.

torch's `clip_grad_norm_` stacks the per-gradient norms into one tensor, which DTensors allow only
when every gradient lives on the same mesh. Under tensor parallelism they do not: the parallelized
layers' gradients are DTensors on the tp mesh (or on FSDP2's (dp_shard, tp) mesh), the others plain
tensors (or DTensors on the dp mesh). So the norm is taken per mesh, each group's made whole (a
collective over that mesh), and the groups' norms combined: the p-norm of the groups' p-norms is
the p-norm of all (the max of the maxima for "inf"). On a single mesh, or without DTensors, this is
exactly torch's computation.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _by_mesh(tensors: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(getattr(tensor, "device_mesh", None), []).append(tensor)
    return groups


def _whole(norm: torch.Tensor) -> torch.Tensor:
    # A norm over DTensors is a DTensor holding a partial value: full_tensor() reduces it.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def total_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The `norm_type`-norm of all `grads` together, a whole tensor on every process.

    Every process must call it with gradients on the same meshes (each mesh's norm is a collective).
    """
    groups = _by_mesh(grads)
    if len(groups) <= 1:
        return _whole(torch.nn.utils.get_total_norm([g for group in groups.values() for g in group], norm_type))
    norms = [_whole(torch.nn.utils.get_total_norm(group, norm_type)) for group in groups.values()]
    device = norms[0].device
    return torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scales the gradients of `parameters` to a total norm of at most `max_norm`.

    Returns:
        The total norm before clipping, a whole tensor on every process.
    """
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    groups = _by_mesh(grads)
    if len(groups) <= 1:  # torch's own path: one mesh or none
        return _whole(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type))
    norm = total_norm(grads, norm_type)
    # torch's clipping rule (clip_grads_with_norm_), which takes parameters, not their DTensor parts.
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # Scaling is elementwise, so each DTensor's local part is scaled in place, whatever its placement.
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        by_device.setdefault(local.device, []).append(local)
    for device, locals_ in by_device.items():
        torch._foreach_mul_(locals_, coefficient.to(device))
    return norm
