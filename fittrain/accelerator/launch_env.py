"""The environment contract between `fittrain launch` (or `accelerate launch`) and the Accelerator.

The launcher exports the options the workers must know under Accelerate's own environment
variables; `Accelerator` and `PartialState` read them as the defaults of the matching arguments,
so a script that passes nothing picks them up and one that passes a value keeps its own.
`fittrain.launch.config` writes them; this module names and reads them, so the Accelerator
never imports the launcher.
"""

from __future__ import annotations

import os
from typing import Any

from fittrain.common.reprs import short_repr
from fittrain.step.precision import PRECISIONS

#: Accelerate's environment variables, read by `fittrain.Accelerator` as argument defaults.
MIXED_PRECISION_ENV = "ACCELERATE_MIXED_PRECISION"
ACCUMULATION_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
DYNAMO_BACKEND_ENV = "ACCELERATE_DYNAMO_BACKEND"
USE_CPU_ENV = "ACCELERATE_USE_CPU"
DEBUG_ENV = "ACCELERATE_DEBUG_MODE"


def launch_defaults(mixed_precision: str | None, gradient_accumulation_steps: int,
                    cpu: bool) -> tuple[str | None, int, bool]:
    """The Accelerator's arguments with what `fittrain launch` (or `accelerate launch`) exported.

    As in Accelerate, the environment fills only what the script left at its default:
    `mixed_precision=None`, `gradient_accumulation_steps=1` and `cpu=False`.

    Raises:
        ValueError: for a malformed variable, naming it and the value.
    """
    if mixed_precision is None:
        mixed_precision = _precision_from_environment()
    if gradient_accumulation_steps == 1 and os.environ.get(ACCUMULATION_ENV, "").strip():
        value = os.environ[ACCUMULATION_ENV].strip()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"Environment variable {ACCUMULATION_ENV} must be a positive integer. Received: "
                             f"{ACCUMULATION_ENV}={value!r}. Set it to e.g. 4 (fittrain launch "
                             "--gradient_accumulation_steps 4 does), or unset it.")
        gradient_accumulation_steps = int(value)
    cpu = cpu or os.environ.get(USE_CPU_ENV, "").strip().lower() in ("1", "true", "yes")
    return mixed_precision, gradient_accumulation_steps, cpu


def _precision_from_environment() -> str | None:
    """ACCELERATE_MIXED_PRECISION, checked here so that a bad value names the variable, not the argument."""
    value = os.environ.get(MIXED_PRECISION_ENV, "")
    if value.strip() and value.strip().lower() not in PRECISIONS:
        choices = ", ".join(repr(p) for p in PRECISIONS[:-1]) + f" or {PRECISIONS[-1]!r}"
        raise ValueError(f"Environment variable {MIXED_PRECISION_ENV} must be one of {choices}. Received: "
                         f"{MIXED_PRECISION_ENV}={short_repr(value)}. Set it to one of them (`fittrain launch "
                         "--mixed_precision bf16` does), or unset it.")
    return value.strip().lower() or None


def dynamo_default(backend: Any) -> Any:
    """`Accelerator(dynamo_backend=None)` takes what `fittrain launch --dynamo_backend` exported."""
    if backend is None:
        return os.environ.get(DYNAMO_BACKEND_ENV, "").strip() or None
    return backend
