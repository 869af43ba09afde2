"""Strategy names: "auto", "ddp", "fsdp", and which one a run uses.

The strategies themselves (wrapping, gradient sync, clipping, state) are objects in
`fittrain.distributed.strategies`; the Accelerator builds one from the name resolved here.
`is_fsdp` and `unwrap` are re-exported from `fittrain.distributed.wrappers` for the callers that
still import them from here.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, cast

import torch

from fittrain.common.checks import check_choice
from fittrain.distributed.strategies.fsdp import FSDP2Strategy, gathered_state_dict
from fittrain.distributed.strategies.parameters import rebind_optimizer
from fittrain.distributed.wrappers import is_fsdp, unwrap

__all__ = ["STRATEGIES", "STRATEGY_ENV", "check_strategy", "full_state_dict", "is_fsdp", "load_full_state_dict",
           "load_optimizer_state_dict", "optimizer_state_dict", "rebind_optimizer", "resolve_strategy", "unwrap"]

STRATEGIES = ("auto", "ddp", "fsdp")

#: `fittrain launch --strategy X` exports this; `resolve_strategy` honours it for strategy="auto".
STRATEGY_ENV = "FITTRAIN_STRATEGY"


def check_strategy(strategy: Any, source: str = "strategy") -> str:
    """Validates a strategy name.

    Args:
        strategy: The value to check.
        source: How the value was given, for the error message (argument or environment variable).

    Returns:
        `strategy`, unchanged.

    Raises:
        ValueError: listing the valid strategies and the value received.
    """
    return check_choice(source, strategy, STRATEGIES)


def resolve_strategy(strategy: Any) -> str:
    """The strategy to use: `strategy`, or the launcher's FITTRAIN_STRATEGY when it is "auto".

    An explicit argument in the script wins over the launcher, as in Accelerate, where code
    overrides the config file.

    Raises:
        ValueError: when either value is not a valid strategy.
    """
    strategy = check_strategy(strategy)
    from_launcher = os.environ.get(STRATEGY_ENV, "").strip()
    if strategy == "auto" and from_launcher:
        return check_strategy(from_launcher.lower(), STRATEGY_ENV)
    return strategy


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's complete state dict, gathered from shards under FSDP2 (every rank calls
    it; only the main process gets the tensors). Prefer `Accelerator.get_state_dict`, which asks the
    run's strategy; this is kept for scripts that have a model and no Accelerator."""
    model = unwrap(model)
    if is_fsdp(model):
        return gathered_state_dict(model)
    return {k: v.detach() for k, v in model.state_dict().items()}


# Transitional: tests/distributed/scripts/fsdp_worker.py calls these three until it asks its Accelerator's
# `distributed_strategy` (the same methods). FSDP2Strategy's state methods serve sharded and plain models
# alike and read no process facts, so one built without them is enough here.
def _state_methods() -> FSDP2Strategy:
    return FSDP2Strategy(cast(Any, None))


def optimizer_state_dict(optimizer: torch.optim.Optimizer, models: Iterable[torch.nn.Module]) -> dict[str, Any]:
    """`Strategy.optimizer_state_dict`, for a caller without an Accelerator."""
    return _state_methods().optimizer_state_dict(optimizer, models)


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """`Strategy.load_full_state_dict`, for a caller without an Accelerator."""
    _state_methods().load_full_state_dict(model, state_dict)


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, models: Iterable[torch.nn.Module],
                              state_dict: dict[str, Any]) -> None:
    """`Strategy.load_optimizer_state_dict`, for a caller without an Accelerator."""
    _state_methods().load_optimizer_state_dict(optimizer, models, state_dict)
