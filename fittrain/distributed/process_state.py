"""Process and distributed facts: rank, world size and device, read from torchrun's environment
(or, without torchrun, from SLURM's: see fittrain/distributed/slurm.py).

A single process is simply the world-size-1 case, so nothing above this module branches on
"distributed or not": it asks a `ProcessState` for its rank, world size, device and barrier.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import enum
import importlib
import os
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist

from fittrain.distributed.launch_guard import guard_worker
from fittrain.distributed.slurm import slurm_process
from fittrain.distributed.teardown import leave_process_group

#: How long a collective waits for a peer before failing. A peer that dies is noticed at once by
#: torchrun, which stops the whole job; the timeout covers a peer that is alive but stuck. It matches
#: torch's and Accelerate's default, because the main process may legitimately keep the others
#: waiting in a barrier for a long time (downloading data in `main_process_first`, writing a large
#: checkpoint). Set the environment variable below to fail faster.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

#: Environment variable that overrides DEFAULT_TIMEOUT, in seconds (e.g. FITTRAIN_COLLECTIVE_TIMEOUT=120).
TIMEOUT_ENV = "FITTRAIN_COLLECTIVE_TIMEOUT"


class DistributedType(str, enum.Enum):
    """How the processes of a run are organised, with Accelerate's names."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    # Accelerate's other setups, which fittrain never runs: scripts compare with them.
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def _env_int(name: str, default: int) -> int:
    """An integer environment variable, `default` when unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"Environment variable {name} must be an integer, as torchrun sets it. Received: {name}={value!r}."
        ) from None


def collective_timeout() -> datetime.timedelta:
    """The collective timeout: FITTRAIN_COLLECTIVE_TIMEOUT seconds when set, else DEFAULT_TIMEOUT.

    Raises:
        ValueError: when the variable is not a positive number of seconds.
    """
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"Environment variable {TIMEOUT_ENV} must be a positive number of seconds. "
            f"Received: {TIMEOUT_ENV}={value!r}. Set it to e.g. 600, or unset it for "
            f"{int(DEFAULT_TIMEOUT.total_seconds())} seconds."
        )
    return datetime.timedelta(seconds=seconds)


def _check_rendezvous(world_size: int, rank: int) -> None:
    """Fails early, with a launcher hint, when torchrun's variables are incomplete or inconsistent."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"Environment variable RANK must be in [0, WORLD_SIZE). Received: RANK={rank}, "
            f"WORLD_SIZE={world_size}. Launch with `fittrain launch` or torchrun, which set both."
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world_size} asks for several processes, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so the processes cannot find each other. "
            "Launch with `fittrain launch --num_processes N script.py` or torchrun, which set them."
        )


def _launcher_facts() -> tuple[int, int, int, str | None]:
    """World size, rank, local rank and the default rendezvous URL, from the launcher's variables.

    torchrun's variables win; without them an srun task's SLURM variables describe the process,
    and rank 0 listens at the first host of the job (see fittrain/distributed/slurm.py). None as the URL
    means torchrun's MASTER_ADDR and MASTER_PORT (env://).
    """
    slurm = slurm_process()
    if slurm is not None:
        init_method = slurm.init_method if slurm.world_size > 1 else None
        return slurm.world_size, slurm.rank, slurm.local_rank, init_method
    return _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0), None


def _restarted_group_store(world_size: int, timeout: datetime.timedelta) -> Any:
    """For workers that torchrun restarted (`--max_restarts`), the launcher's store under a prefix of
    this attempt's own; None otherwise (torch's env:// rendezvous).

    torchrun's workers share their launcher's store, and torch adds no prefix per attempt, so a
    restarted group can read the dead workers' gloo addresses left from the attempt before and
    fail to connect ("Connection refused"), now and then.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"/fittrain/attempt_{attempt}", store)


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
    MASTER_ADDR/PORT), else from SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    SLURM_NODELIST). Without either it describes one process on one device.

    Attributes:
        num_processes: World size.
        process_index: Global rank.
        local_process_index: Rank on this node.
        device: The device this process computes on.
        backend: The torch.distributed backend in use, or None for one process.
        strategy: How models are parallelised ("auto", "ddp" or "fsdp"): it names the setup
            (`distributed_type`).

    It also answers Accelerate's state questions (`accelerator.state.distributed_type`,
    `wait_for_everyone()`, `split_between_processes`, ...), so scripts that use
    `accelerator.state` as Accelerate's `AcceleratorState` run unchanged.
    """

    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    backend: str | None
    strategy: str = "auto"

    @classmethod
    def from_environment(cls, cpu: bool = False, timeout: datetime.timedelta | None = None,
                         backend: str | None = None, init_method: str | None = None,
                         strategy: str = "auto") -> "ProcessState":
        """Reads torchrun's variables and joins the process group when there is more than one process.

        The group is joined once per process: gloo on the CPU, nccl on CUDA, where each process
        uses `cuda:LOCAL_RANK`. A group that already exists (made by the user or an earlier
        Accelerator) is adopted as it is.

        Args:
            cpu: Force the CPU even when an accelerator is present.
            timeout: How long collectives wait for a peer before failing; default:
                `collective_timeout()` (FITTRAIN_COLLECTIVE_TIMEOUT or 30 minutes).
            backend: "gloo" or "nccl" for a group joined here; default: nccl on CUDA, else gloo.
            init_method: torch's rendezvous URL for a group joined here; default: torchrun's
                MASTER_ADDR and MASTER_PORT, or under SLURM the job's first host and port.
            strategy: The Accelerator's strategy, for `distributed_type`.

        Returns:
            The state of this process.

        Raises:
            ValueError: when torchrun's (or SLURM's) variables are malformed or incomplete.
        """
        guard_worker()  # a `fittrain launch` worker dies with its launcher, even one killed by SIGKILL
        world_size, rank, local_rank, launcher_init = _launcher_facts()
        device = _pick_device(cpu, local_rank)
        chosen, backend = backend, None
        if dist.is_available() and dist.is_initialized():
            # A user (or a test harness) already joined a group: adopt it rather than fight it.
            world_size, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
        elif world_size > 1:
            init_method = init_method or launcher_init
            if init_method is None:
                _check_rendezvous(world_size, rank)
            backend = chosen or ("nccl" if device.type == "cuda" else "gloo")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # torch._dynamo, first imported once a group exists (DDP's constructor does), keeps
            # references to the group that destroy_process_group cannot drop: gloo's worker threads
            # then outlive it into interpreter finalization, the abort fittrain.distributed.teardown prevents.
            # Imported before the group, it holds none. DDP and FSDP import it anyway.
            importlib.import_module("torch._dynamo")
            timeout = timeout or collective_timeout()
            store = _restarted_group_store(world_size, timeout) if init_method is None else None
            dist.init_process_group(backend=backend, init_method=None if store else init_method, store=store,
                                    timeout=timeout, world_size=world_size, rank=rank)
            # The group fittrain made is destroyed before the interpreter finalizes, even if the
            # script never calls end_training(): see fittrain.distributed.teardown for the crash this avoids.
            atexit.register(leave_process_group)
        return cls(world_size, rank, local_rank, device, backend, strategy)

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

    @property
    def is_last_process(self) -> bool:
        """Whether this is the last global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part (Accelerate's name)."""
        return self.is_distributed

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for this setup: NO, MULTI_CPU, MULTI_GPU or FSDP."""
        if not self.is_distributed:
            return DistributedType.NO
        if self.strategy == "fsdp":
            return DistributedType.FSDP
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    def wait_for_everyone(self) -> None:
        """Accelerate's name for `barrier`."""
        self.barrier()

    def destroy_process_group(self) -> None:
        """Accelerate's name for `shutdown`."""
        self.shutdown()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print`, on each node's main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """A context that yields this process's share of `inputs` (see `collectives`)."""
        from fittrain.distributed.collectives import split_between_processes  # collectives imports this module

        return split_between_processes(inputs, self, apply_padding)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Runs the block on the main process first, then on the others."""
        if not self.is_main_process:
            self.barrier()
        yield
        if self.is_main_process:
            self.barrier()

    local_main_process_first = main_process_first  # globally ordered, which also orders every node

    def barrier(self) -> None:
        """Waits until every process reaches this point; free with one process.

        Raises:
            RuntimeError: after the collective timeout, when a peer never arrives.
        """
        if not self.is_distributed:
            return
        if self.backend == "nccl":
            # Naming the device spares NCCL from guessing it (and warning) from the rank.
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def shutdown(self) -> None:
        """Leaves the process group, so the script exits cleanly. Safe to call twice."""
        if self.is_distributed:
            leave_process_group()

