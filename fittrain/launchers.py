"""Accelerate's in-Python launchers: `notebook_launcher` and `debug_launcher`.

Both start processes on this machine from a running Python (a notebook, a test) and run one
function in each, with torchrun's variables set, so an `Accelerator` inside the function joins
them as under `fittrain launch`. `notebook_launcher` goes through torch's elastic launcher (the
engine of torchrun); `debug_launcher` forks plain CPU processes, for quick checks of
multi-process code.

Example:
    >>> def train(lr):
    ...     accelerator = Accelerator()
    ...     ...
    >>> notebook_launcher(train, args=(3e-4,), num_processes=2)
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fittrain.accelerator.launch_env import MIXED_PRECISION_ENV, USE_CPU_ENV
from fittrain.common.checks import check_positive_int
from fittrain.step.precision import check_precision


def notebook_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Runs `function(*args)` on `num_processes` processes per machine (Accelerate's function).

    With one process (or None on a machine without GPUs) the function runs here, in this process.
    Otherwise torch's elastic launcher forks the processes (so the function may be defined in the
    notebook), and the call returns when all of them finished; the first failure is raised.

    Raises:
        ValueError: when a process group exists already in this process (launch before building
            an Accelerator), or for a bad argument.
    """
    mixed_precision = check_precision(mixed_precision)
    if num_processes is None:
        num_processes = torch.cuda.device_count() if torch.cuda.is_available() else 1
    check_positive_int("num_processes", num_processes)
    check_positive_int("num_nodes", num_nodes)
    if num_processes * num_nodes == 1:
        with _environment({MIXED_PRECISION_ENV: mixed_precision}):
            function(*args)
        return
    if dist.is_available() and dist.is_initialized():
        raise ValueError("notebook_launcher() must run before any process group exists in this process: an "
                         "Accelerator was built here already. Restart the kernel, and build the Accelerator inside "
                         "the launched function only.")
    # torch's elastic launcher: only a launch of several processes needs it, and it is slow to import.
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=num_processes, run_id=rdzv_id,
        rdzv_endpoint=rdzv_endpoint or f"{master_addr}:{use_port}", rdzv_backend=rdzv_backend,
        rdzv_configs={**(rdzv_conf or {}), "rank": node_rank}, max_restarts=max_restarts,
        monitor_interval=monitor_interval, start_method="fork", log_line_prefix_template=log_line_prefix_template)
    with _environment({MIXED_PRECISION_ENV: mixed_precision}):
        elastic_launch(config=config, entrypoint=function)(*args)


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> None:
    """Runs `function(*args)` on `num_processes` forked CPU processes (Accelerate's function), to
    check multi-process code on any machine. Returns when all finished; a failure is raised."""
    check_positive_int("num_processes", num_processes)
    port = _free_port()
    with _environment({USE_CPU_ENV: "true"}):
        mp.start_processes(_Worker(function, num_processes, port), args=args, nprocs=num_processes,
                           start_method="fork")


class _Worker:
    """One forked process of `debug_launcher`: torchrun's variables for its rank, then the function."""

    def __init__(self, function: Callable[..., Any], world_size: int, port: int) -> None:
        self.function, self.world_size, self.port = function, world_size, port

    def __call__(self, index: int, *args: Any) -> None:
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(self.world_size),
                          LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        self.function(*args)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block (the launched processes inherit them)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
