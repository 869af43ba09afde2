"""Parameters that wrapping replaced, and optimizer states keyed by index or by parameter name.

The optimizer rule under FSDP2:
    `fully_shard` replaces every parameter of the model with a sharded `DTensor` parameter, so an
    optimizer must hold the sharded parameters, not the originals. Either build the optimizer
    after `prepare(model)`, on `model.parameters()`, or build it on the plain model before and
    pass it to `prepare` (in the model's call or a later one): prepare then re-binds it to the
    sharded parameters (`rebind_optimizer`, with the replacements `ReplacedParameters` remembers).
    The re-bound optimizer must not have stepped yet, because its state would still belong to the
    old, full-size parameters. DDP keeps the parameters, so under DDP any order works.

    Example:
        >>> optimizer = torch.optim.AdamW(model.parameters())      # plain model: fine
        >>> model, optimizer = accelerator.prepare(model, optimizer)  # re-bound to the shards
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch import nn

from fittrain.distributed.wrappers import unwrap


class ReplacedParameters:
    """The parameters that wrapping replaced (FSDP2 shards them), remembered across prepare() calls.

    Both sides are weak references: an entry matters only while something, such as an optimizer
    built on the plain model, still holds the old parameter, and it must not keep either alive.
    A weak reference also guards against a reused `id`: a dead entry never matches.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def record(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """Notes that `new` replaced `old`."""
        self._entries[id(old)] = (weakref.ref(old), weakref.ref(new))

    def mapping(self) -> dict[int, nn.Parameter]:
        """id(old parameter) -> new parameter, for the entries whose both sides are still alive."""
        live: dict[int, nn.Parameter] = {}
        for key, (old, new) in list(self._entries.items()):
            replacement = new()
            if old() is None or replacement is None:
                del self._entries[key]
            else:
                live[key] = replacement
        return live


def rebind_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Points `optimizer` at new parameter objects (FSDP2 replaces them with sharded ones).

    See the module docstring for the rule this serves.

    Args:
        optimizer: An optimizer built on the plain model, before any step.
        mapping: id(old parameter) -> new parameter.

    Raises:
        ValueError: when the optimizer already holds state for a parameter being replaced.
    """
    stale = [p for p in optimizer.state if id(p) in mapping]
    if stale:
        raise ValueError(
            "prepare() re-binds an optimizer built before it to the sharded FSDP2 parameters, but this "
            f"optimizer has already stepped (it holds state for {len(stale)} parameters), and that state "
            "belongs to the unsharded ones. Received an optimizer with state; prepare it before its first step, "
            "or build it after prepare(model) on model.parameters()."
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a prepared one.

    torch.distributed.checkpoint may run a zero-lr step to create missing state; it must reach
    the real optimizer, not AcceleratedOptimizer, whose step() skips inside accumulation windows.
    """
    return getattr(optimizer, "optimizer", optimizer)


def rekeyed(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, models: Iterable[nn.Module],
            by_name: bool) -> dict[str, Any]:
    """The optimizer state keyed as the live optimizer loads it: by parameter name under FSDP2, by
    index otherwise. A run resumed on another number of processes may get the other kind: FSDP2
    shards nothing on one process, whose full optimizer state is keyed by index.

    Indices count the optimizer's parameters in its groups' order; names are the unwrapped
    model's parameter names. A state that cannot be mapped is returned unchanged (torch's own
    loader then says what is wrong).
    """
    params = [p for group in inner_optimizer(optimizer).param_groups for p in group["params"]]
    names = {id(p): name for model in models for name, p in unwrap(model).named_parameters()}
    keys = [names.get(id(p)) for p in params]
    saved = state_dict.get("state", {})
    if None in keys or not all(isinstance(k, int if by_name else str) for k in saved):
        return state_dict
    old_to_new = dict(enumerate(keys)) if by_name else {name: i for i, name in enumerate(keys)}
    try:
        return {**state_dict, "state": {old_to_new[k]: v for k, v in saved.items()},
                "param_groups": [{**group, "params": [old_to_new[k] for k in group["params"]]}
                                 for group in state_dict["param_groups"]]}
    except (KeyError, TypeError):
        return state_dict


def set_hyperparameters(optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Sets the groups' hyperparameters (lr, ...) of a saved state, in order, and nothing else.

    For a stateless optimizer (plain SGD): torch's sharded loaders cannot tell the device of an
    empty state, and there is nothing to shard.
    """
    for group, saved in zip(inner_optimizer(optimizer).param_groups, state_dict.get("param_groups", ())):
        group.update({key: value for key, value in saved.items() if key != "params"})
