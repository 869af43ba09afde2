"""Strategy names: "auto", "ddp", "fsdp", and which one a run uses.

The strategies themselves (wrapping, gradient sync, clipping, state) are objects in
`fittrain.distributed.strategies`; the Accelerator builds one from the name resolved here.
`is_fsdp` and `unwrap` are re-exported from `fittrain.distributed.wrappers` for the callers that
still import them from here.
"""

from __future__ import annotations

import os
from typing import Any

from fittrain.common.checks import check_choice
from fittrain.distributed.strategies.parameters import rebind_optimizer
from fittrain.distributed.wrappers import is_fsdp, unwrap

__all__ = ["STRATEGIES", "STRATEGY_ENV", "check_strategy", "is_fsdp", "rebind_optimizer", "resolve_strategy", "unwrap"]

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
