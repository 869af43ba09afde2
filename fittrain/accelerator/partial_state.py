"""`PartialState`: Accelerate's read-only view of the process facts, without a hidden global.

Accelerate keeps one shared state object per process; fittrain keeps none. Every `PartialState()`
reads the same sources (torchrun's environment and the torch.distributed process group, which it
joins when the environment asks for one and nothing joined yet), so two instances, or a
`PartialState` and an `Accelerator`, always agree: there is nothing that could disagree.

Example:
    >>> state = PartialState()
    >>> with state.split_between_processes(prompts) as mine:
    ...     outputs = [generate(p) for p in mine]
"""

from __future__ import annotations

import os
from typing import Any

from fittrain.accelerator.launch_env import DEBUG_ENV, MIXED_PRECISION_ENV, launch_defaults
from fittrain.distributed.parallel import resolve_strategy
from fittrain.distributed.process_methods import ProcessHelpers
from fittrain.distributed.process_state import DistributedType, ProcessState


class PartialState(ProcessHelpers):
    """The facts of this process (rank, world size, device) and Accelerate's helpers on them.

    It has `num_processes`, `process_index`, `local_process_index`, `device`, `is_main_process`,
    `is_local_main_process`, `is_last_process`, `use_distributed`, `distributed_type`,
    `wait_for_everyone()`, `main_process_first()`, `split_between_processes()`, `print()`, the
    `on_main_process`-style decorators and the collectives. It cannot be changed.

    Args:
        cpu: Use the CPU even when an accelerator is present (also `fittrain launch --cpu`).
    """

    def __init__(self, cpu: bool = False) -> None:
        _, _, cpu = launch_defaults(None, 1, cpu)
        object.__setattr__(self, "state", ProcessState.from_environment(cpu=cpu, strategy=self._strategy()))

    @staticmethod
    def _strategy() -> str:
        return "ddp"  # FSDP is a property of an Accelerator's strategy, not of the processes

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "debug":  # the one setting: process-wide, as Accelerate's shared state has it
            type(self).debug.fset(self, value)
            return
        raise AttributeError(f"PartialState is a read-only view of the process facts; it cannot set {name!r}. "
                             "The facts come from torchrun's environment and the process group.")

    @property
    def debug(self) -> bool:
        """Accelerate's debug mode: collectives first check that every process passes the same
        shapes, and raise `DistributedOperationException` instead of hanging or aborting. It is
        process-wide (the environment variable ACCELERATE_DEBUG_MODE; `fittrain launch --debug`)."""
        return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")

    @debug.setter
    def debug(self, value: bool) -> None:
        os.environ[DEBUG_ENV] = "true" if value else "false"

    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU or MULTI_GPU (or FSDP for `AcceleratorState` under `--strategy fsdp`)."""
        return self.state.distributed_type

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend ("gloo", "nccl"), or None for one process."""
        return self.state.backend

    def destroy_process_group(self) -> None:
        """Leaves the process group (every process must call it), as `Accelerator.end_training` does."""
        self.state.shutdown()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(distributed_type={self.distributed_type.value}, "
                f"num_processes={self.num_processes}, "
                f"process_index={self.process_index}, local_process_index={self.local_process_index}, "
                f"device={self.device})")


class AcceleratorState(PartialState):
    """Accelerate's `AcceleratorState()`: `PartialState` plus the launch settings.

    Accelerate's is a process-wide singleton that the Accelerator fills in; fittrain has no such
    global, so this one reads what `fittrain launch` exported (`mixed_precision`, the strategy for
    `distributed_type`). An Accelerator's own settings are on `accelerator.state` and the
    Accelerator itself.
    """

    @staticmethod
    def _strategy() -> str:
        return resolve_strategy("auto")

    @property
    def mixed_precision(self) -> str:
        """"no", "fp16" or "bf16", as `fittrain launch --mixed_precision` exported it."""
        return os.environ.get(MIXED_PRECISION_ENV, "").strip().lower() or "no"
