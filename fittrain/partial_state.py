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

from typing import Any

from .launch_config import launch_defaults
from .process_methods import ProcessHelpers
from .state import DistributedType, ProcessState


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
        object.__setattr__(self, "state", ProcessState.from_environment(cpu=cpu))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PartialState is a read-only view of the process facts; it cannot set {name!r}. "
                             "The facts come from torchrun's environment and the process group.")

    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU or MULTI_GPU (FSDP is a property of an Accelerator's strategy)."""
        return self.state.distributed_type("ddp")

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend ("gloo", "nccl"), or None for one process."""
        return self.state.backend

    def destroy_process_group(self) -> None:
        """Leaves the process group (every process must call it), as `Accelerator.end_training` does."""
        self.state.shutdown()

    def __repr__(self) -> str:
        return (f"PartialState(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
                f"process_index={self.process_index}, local_process_index={self.local_process_index}, "
                f"device={self.device})")
