"""The one runner of the tests' real jobs: fresh interpreters, torchrun, `fittrain launch`, forked ranks.

Nothing is mocked: every job's workers are real processes that join a real gloo process group.
Jobs about launching (torchrun, `fittrain launch`, signals, SLURM) start real launchers
(`torchrun`, `fittrain_launch`, `python_script` command lines); jobs about the library's
behaviour fork their ranks from a process with torch already imported (`forked`, see
tests/support/ranks.py), which saves each rank the seconds of importing torch.

A `Job` runs in the background: a test may signal it, wait for it or kill it. Every job has a
deadline after which it is killed with every process it started, so a broken collective fails a
test instead of hanging it, and the suite's guard (tests/conftest.py) ends the jobs a failing test
left running. `run` and `run_together` wait for jobs to end and return how each `Finished`.

Worker scripts live in scripts/ beside this module; they import each other as top-level modules
(`training`, `stream_data`, ...), since a script's own folder is first on its sys.path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from types import ModuleType
from typing import Any, ClassVar, Sequence

import pytest

from support import ranks as forked_ranks

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
#: Longest a job may run before it is killed; generous, because the machine may be shared.
JOB_TIMEOUT = 240.0
#: Collectives in workers fail after this many seconds, so a desynchronised job ends early.
WORKER_COLLECTIVE_TIMEOUT = "90"
#: torchrun's (and `fittrain launch`'s) variables, which must not leak from an outer launcher into a job.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FITTRAIN_STRATEGY")
#: Marks every process of one job (inherited by the workers), so that all of them can be found.
_JOB_MARK = "FITTRAIN_TEST_JOB"
#: Launcher flags whose value is the rendezvous port, and what a port taken by someone else reads like.
_PORT_FLAGS = ("--master-port", "--master_port", "--main_process_port")
_PORT_CLASH = "EADDRINUSE"


@dataclasses.dataclass
class Finished:
    """A finished job: its exit code, its combined stdout and stderr, how long it took, and when
    it ended (wall-clock `time.time()`, comparable with timestamps that workers print)."""

    returncode: int
    output: str
    seconds: float
    ended_at: float

    def check(self) -> Finished:
        """Fails the test with the job's output when it did not exit 0."""
        if self.returncode != 0:
            pytest.fail(f"job exited {self.returncode} after {self.seconds:.1f}s:\n{excerpt(self.output)}")
        return self


#: Each xdist worker takes rendezvous ports from a band of its own, below Linux's ephemeral range
#: (32768-60999, where the OS picks the ports of bind(0) and of outgoing connections) and above the
#: ports SLURM jobs derive from their ids (fittrain.distributed.slurm: 15000-24999, which the SLURM
#: tests use): between `free_port` and the launcher's bind, no other worker's job, nor any
#: connection, is handed that port. Eight bands (tests/conftest.py's MAX_WORKERS) end below 32768.
_PORT_BAND_START, _PORT_BAND_SIZE = 25000, 900
#: Seconds a job killed at its deadline has to print its stacks (SIGABRT) before SIGKILL.
STACK_DUMP_WAIT = 3.0
#: Characters of a failed job's output that the failure message shows.
SHOWN_OUTPUT = 6000
#: The first line of the stacks a Python process prints on SIGABRT (faulthandler).
STACK_DUMP_FIRST_LINE = "Fatal Python error: Aborted"


def excerpt(output: str, limit: int = SHOWN_OUTPUT) -> str:
    """What a failure message shows of a job's output: its last `limit` characters, except that the
    stacks a job killed at its deadline printed are shown from their first line. faulthandler prints
    a stack innermost frame first, where the job hung, so a tail of a deep stack (a job still
    importing, say) would show everything but that; when the stacks are longer than `limit`, their
    start and their end are shown."""
    start = output.find(STACK_DUMP_FIRST_LINE)
    if start < 0 or len(output) - start <= limit:  # no stacks, or the tail holds all of them
        return output[-limit:]
    stacks = output[start:]
    head, tail = limit * 2 // 3, limit // 3
    return f"{stacks[:head]}\n[... {len(stacks) - head - tail} characters of stacks left out ...]\n{stacks[-tail:]}"


def free_port() -> int:
    """A TCP port that was free a moment ago, from this xdist worker's band (the OS's choice when
    the band has none free)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    start = _PORT_BAND_START + _PORT_BAND_SIZE * (int(worker) if worker.isdigit() else 0)
    pick = random.SystemRandom()  # not the seeded global generator: tests seed it alike
    for _ in range(100):
        port = pick.randrange(start, start + _PORT_BAND_SIZE)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment, minus any launcher variables, with one thread per process,
    unbuffered output and the workers' collective timeout; plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    # PYTHONFAULTHANDLER: a job killed at its deadline first gets SIGABRT, on which each Python process
    # prints every thread's stack (Job._kill_all): the test's output then says where a hung job was.
    env.update(FITTRAIN_COLLECTIVE_TIMEOUT=WORKER_COLLECTIVE_TIMEOUT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- command lines
def _script(script: str | pathlib.Path) -> str:
    """A script in scripts/, unless `script` is already an absolute path."""
    return str(SCRIPTS / script)


def python_script(script: str | pathlib.Path, *args: Any) -> list[str]:
    """The command line of `python script args` in a fresh interpreter (a script in scripts/)."""
    return [sys.executable, _script(script), *map(str, args)]


def torchrun(nproc: int, script: str | pathlib.Path, *args: Any, port: int | None = None) -> list[str]:
    """The command line of `python -m torch.distributed.run` for a script in scripts/."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(port or free_port()), _script(script), *map(str, args)]


def fittrain_launch(nproc: int, script: str | pathlib.Path, *args: Any, launch_args: Sequence[str] = ()) -> list[str]:
    """The command line of `python -m fittrain launch` for a script in scripts/."""
    return [sys.executable, "-m", "fittrain", "launch", "--num_processes", str(nproc),
            "--main_process_port", str(free_port()), *launch_args, _script(script), *map(str, args)]


def _with_new_port(args: list[str]) -> list[str]:
    return [str(free_port()) if i and args[i - 1] in _PORT_FLAGS else arg for i, arg in enumerate(args)]


@dataclasses.dataclass(frozen=True)
class Ranks:
    """A job forked from the session's preloaded forkserver instead of started as new interpreters
    (see `forked`, `forked_process`)."""

    nproc: int
    script: pathlib.Path
    args: tuple[str, ...]
    cwd: pathlib.Path | None = None
    #: With torchrun's environment (a rank of a job); without, one process like `python script args`.
    torchrun: bool = True


def forked(nproc: int, script: str | pathlib.Path, *args: Any, cwd: pathlib.Path | None = None) -> Ranks:
    """`nproc` ranks running a script (in scripts/ unless a full path) as torchrun would, in `cwd`,
    forked from a process that has torch and fittrain imported. For jobs about library behaviour,
    not about launching or signals."""
    return Ranks(nproc, SCRIPTS / script, tuple(map(str, args)), cwd)


def forked_process(script: str | pathlib.Path, *args: Any) -> Ranks:
    """One process exactly like a fresh `python script args` (no launcher variables), forked."""
    return Ranks(1, SCRIPTS / script, tuple(map(str, args)), torchrun=False)


# ----------------------------------------------------------------------------- jobs
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


class Job:
    """A job running in the background: a command line in a process group of its own, or `Ranks`.

    Every job is remembered in `Job.open_jobs` until `kill_group` ends it, so that
    `kill_leftovers` (which the suite's guard runs after each test) ends whatever a failing test
    left behind.

    Args:
        args: A command line, or forked `Ranks`.
        env: The job's environment (default `job_env()`).
        timeout: Seconds from the start after which `wait` kills the job and fails the test.
        cwd: The working directory of a command line (forked ranks take theirs from `Ranks`).
        port_retry: Whether `wait` runs once more, on a fresh port, a job whose launcher lost its
            port (see `wait`). Off for jobs that share one rendezvous port with others.
    """

    open_jobs: ClassVar[list[Job]] = []

    def __init__(self, args: Sequence[Any] | Ranks, env: dict[str, str] | None = None,
                 timeout: float = JOB_TIMEOUT, cwd: pathlib.Path | None = None, port_retry: bool = True) -> None:
        self.ranks = args if isinstance(args, Ranks) else None
        self.args = [str(a) for a in args] if self.ranks is None else [str(self.ranks.script), *self.ranks.args]
        self.env = env or job_env()
        self.timeout = timeout
        self.cwd = cwd
        self.finished: Finished | None = None
        self._port_retry = port_retry
        self._start()
        Job.open_jobs.append(self)

    def _start(self) -> None:
        self.began = time.monotonic()
        if self.ranks is not None:
            self.proc: subprocess.Popen | forked_ranks.Job = forked_ranks.Job(
                self.ranks.script, list(self.ranks.args), self.ranks.nproc, self.env, torchrun=self.ranks.torchrun,
                cwd=str(self.ranks.cwd) if self.ranks.cwd else None)
            return
        # Marked, so that `kill_group` finds the workers too: torchrun starts each worker in a
        # session of its own, where killing the launcher's process group would leave them running.
        self.mark = uuid.uuid4().hex
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**self.env, _JOB_MARK: self.mark}, cwd=self.cwd, start_new_session=True)

    @classmethod
    def kill_leftovers(cls) -> None:
        """Kills every job that was started and not yet ended with `kill_group`."""
        for job in list(cls.open_jobs):
            job.kill_group()

    @property
    def pid(self) -> int:
        """The main process (a launcher, or rank 0 of forked ranks)."""
        return self.proc.pid

    @property
    def output(self) -> str:
        """What the job printed, once it ended (empty before)."""
        return self.finished.output if self.finished else ""

    @property
    def returncode(self) -> int | None:
        """The exit code, once it ended (None before)."""
        return self.finished.returncode if self.finished else None

    def running(self) -> bool:
        if isinstance(self.proc, forked_ranks.Job):
            return self.proc.running()
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the job's main process only, as a scheduler or a crash would (its
        DataLoader workers notice on their own; a launcher passes it on to its workers)."""
        os.kill(self.pid, sig)

    def _end(self) -> tuple[str, int | None]:
        """Waits until the deadline for the job to end; returns its output and exit code (None when
        it ran past the deadline and was killed). Whatever is left of it is killed."""
        left = max(self.timeout - (time.monotonic() - self.began), 1.0)
        if isinstance(self.proc, forked_ranks.Job):
            ended = self.proc.wait(left)
            output = self.proc.output()
            self.proc.close()
            code = self.proc.returncode
            return output, (-signal.SIGKILL if code is None else code) if ended else None
        try:
            output, _ = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self._kill_all(dump_stacks=True)
            output, _ = self.proc.communicate()
            return output, None
        self._kill_all()  # a launcher that failed may leave workers behind; usually nothing is left
        return output, self.proc.returncode

    def wait(self, expect: int | None = 0) -> Finished:
        """Waits for the job to end. Fails the test when it runs past its deadline (killing it) or,
        when `expect` is set, when it exits with another code.

        `free_port` releases its port before the launcher binds it, so another process on a busy
        machine may take it in between: a job that failed only because of that ran nothing, and
        is run once more on a fresh port.
        """
        while self.finished is None:
            output, code = self._end()
            if code is None:
                self.finished = Finished(-signal.SIGKILL, output, time.monotonic() - self.began, time.time())
                pytest.fail(f"job ran past {self.timeout:.0f}s and was killed: {' '.join(self.args)}\n"
                            f"{excerpt(output)}")
            if (code != 0 and self._port_retry and self.ranks is None and _PORT_CLASH in output
                    and any(flag in self.args for flag in _PORT_FLAGS)):
                self._port_retry = False
                self.args = _with_new_port(self.args)
                self._start()
                continue
            self.finished = Finished(code, output, time.monotonic() - self.began, time.time())
        if expect is not None and self.finished.returncode != expect:
            pytest.fail(f"job exited {self.finished.returncode} (expected {expect}): {' '.join(self.args)}\n"
                        f"{excerpt(self.finished.output)}")
        return self.finished

    def _kill_all(self, dump_stacks: bool = False) -> None:
        """SIGKILLs the job's process group and every process that carries its mark. With `dump_stacks`
        (a job still running at its deadline, or beside one that was), SIGABRT first: each Python
        process prints every thread's stack (PYTHONFAULTHANDLER, see job_env) into the output."""
        signals = (signal.SIGABRT, signal.SIGKILL) if dump_stacks else (signal.SIGKILL,)
        for sig in signals:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            for pid in _marked_processes(self.mark):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if sig == signal.SIGABRT:
                time.sleep(STACK_DUMP_WAIT)

    def kill_group(self) -> None:
        """Ends the job with every process it started, keeps what it printed (`output`), and
        forgets it. Nothing to do for a job that `wait` saw end."""
        with contextlib.suppress(ValueError):
            Job.open_jobs.remove(self)
        if self.finished is not None:
            return
        if isinstance(self.proc, forked_ranks.Job):
            output = self.proc.output()
            self.proc.close()
        else:
            self._kill_all(dump_stacks=self.running())
            output = ""
            with contextlib.suppress(subprocess.TimeoutExpired):
                output, _ = self.proc.communicate(timeout=30)  # reap it and close its pipe
        code = self.proc.returncode
        self.finished = Finished(-signal.SIGKILL if code is None else code, output,
                                 time.monotonic() - self.began, time.time())


def run(args: Sequence[Any] | Ranks, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT,
        cwd: pathlib.Path | None = None) -> Finished:
    """Runs one job to its end (see `Job.wait`) and returns how it ended, whatever its exit code."""
    job = Job(args, env, timeout, cwd)
    try:
        return job.wait(expect=None)
    finally:
        job.kill_group()


def run_together(commands: list[list[str]], timeout: float = JOB_TIMEOUT) -> list[Finished]:
    """Runs jobs side by side (e.g. the nodes of one multi-node job) and waits for all of them.

    Whatever happens while waiting, no job is left running. Nodes share a rendezvous port, so a
    lost port is not retried (one node alone on a new port would wait for the others forever).
    """
    jobs = [Job(command, timeout=timeout, port_retry=False) for command in commands]
    try:
        return [job.wait(expect=None) for job in jobs]
    finally:
        for job in jobs:
            job.kill_group()


def load_script(name: str) -> ModuleType:
    """Imports scripts/{name}.py into this process under a private name, for in-process checks."""
    spec = importlib.util.spec_from_file_location(f"fittrain_tests_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
