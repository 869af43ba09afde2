"""Helpers that run real multi-process jobs on gloo, on the CPU, and read back what each rank saw.

Nothing is mocked: every job's workers are real processes that join a real process group. Jobs
about launching run `torchrun` or `fittrain launch` (`torchrun`, `fittrain_launch`); jobs about
the library's behaviour fork their ranks from a process with torch already imported (`forked`,
see tests/support/ranks.py), which saves each rank the seconds of importing torch.
Each job gets a free port and a deadline, and a job that overruns is
killed with its whole process group, so a broken collective fails a test instead of hanging it.

This module has a name of its own (not conftest) so test modules can import it unambiguously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import uuid
from types import ModuleType
from typing import Any

import pytest
import torch

from support import ranks as forked_ranks

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
#: Longest a job may run before it is killed; generous, because the machine may be shared.
JOB_TIMEOUT = 240.0
#: Collectives in workers fail after this many seconds, so a desynchronised job ends early.
WORKER_COLLECTIVE_TIMEOUT = "90"
#: torchrun's variables, which must not leak from an outer launcher into a job's environment.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FITTRAIN_STRATEGY")


@dataclasses.dataclass
class Finished:
    """A finished job: its exit code, its combined stdout and stderr, how long it took, and when
    it ended (wall-clock `time.time()`, comparable with timestamps that workers print)."""

    returncode: int
    output: str
    seconds: float
    ended_at: float

    def check(self) -> "Finished":
        """Fails the test with the job's output when it did not exit 0."""
        if self.returncode != 0:
            pytest.fail(f"job exited {self.returncode} after {self.seconds:.1f}s:\n{self.output[-6000:]}")
        return self


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment, minus any launcher variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(FITTRAIN_COLLECTIVE_TIMEOUT=WORKER_COLLECTIVE_TIMEOUT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


#: Marks every process of one job (inherited by the workers), so that all of them can be found.
_JOB_MARK = "FITTRAIN_TEST_JOB"


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a job in its own process group, marked so that `kill` finds all its workers."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**(env or job_env()), _JOB_MARK: mark}, start_new_session=True)
    proc.job_mark = mark  # type: ignore[attr-defined]
    return proc


def _marked_processes(mark: str) -> list[int]:
    """The pids of the live processes whose environment carries `mark` (Linux's /proc)."""
    wanted, found = f"{_JOB_MARK}={mark}".encode(), []
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill(proc: subprocess.Popen) -> None:
    """Kills a job with every process it started. torchrun starts each worker in a session of its
    own, so killing the launcher's process group would leave the workers running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in _marked_processes(getattr(proc, "job_mark", "")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, started: float, timeout: float = JOB_TIMEOUT) -> Finished:
    """Waits for a job; past `timeout` it kills the job's process group and fails the test."""
    try:
        output, _ = proc.communicate(timeout=max(timeout - (time.monotonic() - started), 1.0))
    except subprocess.TimeoutExpired:
        kill(proc)
        output, _ = proc.communicate()
        pytest.fail(f"job still running after {timeout:.0f}s; killed it. Output:\n{output[-6000:]}")
    _kill_stragglers(proc)
    return Finished(proc.returncode, output, time.monotonic() - started, time.time())


def _kill_stragglers(proc: subprocess.Popen) -> None:
    """Kills what is left of a finished job: a launcher that failed may leave workers behind,
    which would otherwise run (or wait) forever. Usually nothing is left."""
    kill(proc)


#: Launcher flags whose value is the rendezvous port, and what a port taken by someone else reads like.
_PORT_FLAGS = ("--master-port", "--main_process_port")
_PORT_CLASH = "EADDRINUSE"


def _with_new_port(args: list[str]) -> list[str]:
    return [str(free_port()) if i and args[i - 1] in _PORT_FLAGS else arg for i, arg in enumerate(args)]


@dataclasses.dataclass(frozen=True)
class Ranks:
    """A job of `nproc` ranks of `script` forked with torchrun's environment (see `forked`)."""

    nproc: int
    script: pathlib.Path
    args: tuple[str, ...]
    cwd: pathlib.Path | None = None


def forked(nproc: int, script: str | pathlib.Path, *script_args: str, cwd: pathlib.Path | None = None) -> Ranks:
    """`nproc` ranks running a script (in scripts/ unless a full path) as torchrun would, in `cwd`,
    forked from a process that has torch and fittrain imported; `run` runs it. For jobs about
    library behaviour, not launching."""
    return Ranks(nproc, SCRIPTS / script, tuple(map(str, script_args)), cwd)


def _run_ranks(job: Ranks, env: dict[str, str] | None, timeout: float) -> Finished:
    started = time.monotonic()
    done = forked_ranks.run(job.script, list(job.args), job.nproc, env or job_env(), timeout,
                            cwd=str(job.cwd) if job.cwd else None)
    if done.timed_out:
        pytest.fail(f"job still running after {timeout:.0f}s; killed it. Output:\n{done.output[-6000:]}")
    return Finished(done.returncode, done.output, time.monotonic() - started, time.time())


def run(args: list[str] | Ranks, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> Finished:
    """Runs one job to the end (see `finish`): a command line, or `forked` ranks.

    `free_port` releases its port before the launcher binds it, so another process on a busy
    machine may take it in between; a job that failed only because of that is run once more on
    a fresh port. Any other failure is returned as it is.
    """
    if isinstance(args, Ranks):
        return _run_ranks(args, env, timeout)
    started = time.monotonic()
    done = finish(start(args, env), started, timeout)
    if done.returncode != 0 and _PORT_CLASH in done.output and any(flag in args for flag in _PORT_FLAGS):
        done = finish(start(_with_new_port(args), env), time.monotonic(), timeout)
    return done


def run_together(commands: list[list[str]], timeout: float = JOB_TIMEOUT) -> list[Finished]:
    """Runs jobs side by side (e.g. the nodes of one multi-node job) and waits for all of them.

    Whatever happens while waiting, no job is left running: the ones still alive are killed.
    """
    started = time.monotonic()
    procs = [start(command) for command in commands]
    try:
        return [finish(proc, started, timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)
                proc.communicate()


def torchrun(nproc: int, script: str, *script_args: str, port: int | None = None) -> list[str]:
    """The command line of `python -m torch.distributed.run` for a script in scripts/."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(port or free_port()), str(SCRIPTS / script), *script_args]


def fittrain_launch(nproc: int, script: str, *script_args: str, launch_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of `python -m fittrain launch` for a script in scripts/."""
    return [sys.executable, "-m", "fittrain", "launch", "--num_processes", str(nproc),
            "--main_process_port", str(free_port()), *launch_args, str(SCRIPTS / script), *script_args]


def read_results(out: pathlib.Path, ranks: int) -> list[dict[str, Any]]:
    """What each rank saved with torch.save, in rank order."""
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def load_script(name: str) -> ModuleType:
    """Imports scripts/{name}.py, which the workers import as a sibling module."""
    spec = importlib.util.spec_from_file_location(f"fittrain_distributed_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_state_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    """Same keys, and every tensor within `atol` of the expected one."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        diff = (actual[key].float() - expected[key].float()).abs().max().item()
        assert diff <= atol, f"{key} differs by {diff:.3g} (allowed {atol:g})"


def assert_state_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys and bit-identical tensors."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{key} differs"
