"""Sharded state dicts of prepared models and optimizers, for sharded checkpoints.

torch.distributed.checkpoint's state_dict API with `full_state_dict=False`: under FSDP2 each rank
gets its own shards (DTensors) and nothing is gathered; a model that is not sharded gives its
plain tensors (the same on every rank, which DCP writes once). Optimizer states are keyed by
parameter name, so they load into another process count. The strategies
(`fittrain.distributed.strategies`) hold the full-state counterparts and call these.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fittrain.distributed.strategies.parameters import inner_optimizer, set_hyperparameters
from fittrain.distributed.wrappers import unwrap

_SHARDED = StateDictOptions(full_state_dict=False)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as this rank holds it: its shards under FSDP2, all of it otherwise."""
    return get_model_state_dict(unwrap(model), options=_SHARDED)


def load_model_state(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads `model_state`'s form (already filled in place by DCP, usually) into the model."""
    set_model_state_dict(unwrap(model), state_dict, options=_SHARDED)


def _owner(optimizer: Any, models: Iterable[nn.Module]) -> nn.Module:
    """The one prepared model all of whose trained parameters `optimizer` holds.

    Raises:
        ValueError: when no single prepared model holds them (say the key names to use).
    """
    held = {id(p) for group in inner_optimizer(optimizer).param_groups for p in group["params"]}
    for model in map(unwrap, models):
        if held <= {id(p) for p in model.parameters()}:
            return model
    raise ValueError(
        "A sharded checkpoint keys optimizer state by parameter name, so each optimizer must train the "
        "parameters of one prepared model. Received an optimizer over parameters of several models (or of "
        "none that was prepared). Build one optimizer per model, or save with "
        "Accelerator(state_dict_type='full').")


def optimizer_state(optimizer: Any, models: Iterable[nn.Module]) -> dict[str, Any]:
    """The optimizer's state as this rank holds it, keyed by parameter name (no gathering)."""
    return get_optimizer_state_dict(_owner(optimizer, models), inner_optimizer(optimizer), options=_SHARDED)


def load_optimizer_state(optimizer: Any, models: Iterable[nn.Module], state: dict[str, Any]) -> None:
    """Loads `optimizer_state`'s form into the optimizer."""
    inner = inner_optimizer(optimizer)
    if not any(isinstance(v, torch.Tensor) for per_param in state.get("state", {}).values()
               for v in per_param.values()):
        set_hyperparameters(optimizer, state)  # a stateless optimizer (plain SGD): nothing to place
        return
    set_optimizer_state_dict(_owner(optimizer, models), inner, state, options=_SHARDED)


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole CPU tensors of some of a state dict's DTensors, gathered one at a time (every rank
    calls it with the same keys: each gather is a collective)."""
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for key, value in tensors.items()}
