"""Process and distributed facts: rank, world size and device, read from torchrun's environment.

A single process is simply the world-size-1 case, so nothing above this module branches on
"distributed or not": it asks a `ProcessState` for its rank, world size, device and barrier.
"""

from __future__ import annotations

import datetime
import enum
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Collectives give up after this long instead of hanging when a peer died.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class DistributedType(str, enum.Enum):
    """How the processes of a run are organised, with Accelerate's names."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer, as torchrun sets it. Received: {name}={value!r}."
        ) from None


def _pick_device(cpu: bool, local_rank: int) -> torch.device:
    """cuda, then mps, then cpu: the fastest device present, unless `cpu=True` forces the CPU."""
    if cpu:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass(frozen=True)
class ProcessState:
    """Where this process stands in the run.

    Built once per Accelerator from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT). Without those variables it describes one process on one device.

    Attributes:
        num_processes: World size.
        process_index: Global rank.
        local_process_index: Rank on this node.
        device: The device this process computes on.
        backend: The torch.distributed backend in use, or None for one process.
    """

    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    backend: str | None

    @classmethod
    def from_environment(cls, cpu: bool = False, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> "ProcessState":
        """Reads torchrun's variables and joins the process group when there is more than one process.

        Args:
            cpu: Force the CPU even when an accelerator is present.
            timeout: How long collectives wait for a peer before failing.

        Returns:
            The state of this process.
        """
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", 0)
        device = _pick_device(cpu, local_rank)
        backend = None
        if dist.is_available() and dist.is_initialized():
            # A user (or a test harness) already joined a group: adopt it rather than fight it.
            world_size, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
        elif world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend=backend, timeout=timeout)
        return cls(world_size, rank, local_rank, device, backend)

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0, the process that writes shared files."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 on its node."""
        return self.local_process_index == 0

    def distributed_type(self, strategy: str) -> DistributedType:
        """Accelerate's name for this setup under the given strategy."""
        if not self.is_distributed:
            return DistributedType.NO
        if strategy == "fsdp":
            return DistributedType.FSDP
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    def barrier(self) -> None:
        """Waits until every process reaches this point; free with one process."""
        if self.is_distributed:
            dist.barrier()

    def shutdown(self) -> None:
        """Leaves the process group, so the script exits cleanly."""
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()
