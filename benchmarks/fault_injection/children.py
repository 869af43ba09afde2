"""The child processes: their command lines, how they are bounded and killed, and what they report.

Every child runs this package again (``python -m benchmarks.fault_injection <role> ...``, see
``ROLES`` in ``__main__``), in a session of its own, so that killing its process group also kills
whatever it started (torchrun's workers). Children report to the parent with JSON lines that start
with `EVENT` in their logs. Every wait has a deadline; a child past it is killed and counts as hung.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: What `python -m` runs to start a child in a role.
MODULE = __name__.rpartition(".")[0]
#: Longest a child process may live before its whole process group is killed (it then counts as hung).
JOB_TIMEOUT_S = 150.0
#: Prefix of the JSON lines with which child processes report to this one.
EVENT = "FAULT-EVENT "
#: Epochs of the 2-rank job: 32 optimizer steps, with a preemption check every 10.
SIGTERM_EPOCHS = 4
#: Marks every process a child starts (inherited): torchrun starts its workers in sessions of their
#: own, which killing the child's process group misses, so `Child.kill` finds them by this mark.
_MARK = "FAULT_INJECTION_CHILD"
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FITTRAIN_STRATEGY")


# ===================================================================== command lines
def role_args(role: str, *extra: Any) -> list[Any]:
    """The command line of a child that plays `role` (``_job``, ``_worker`` or ``_writer``)."""
    return [sys.executable, "-m", MODULE, role, *extra]


def job_args(project: pathlib.Path, *extra: Any) -> list[Any]:
    """The training job on one process."""
    return role_args("_job", "--project", project, *extra)


def torchrun_args(project: pathlib.Path, *extra: Any) -> list[Any]:
    """The job on 2 ranks; --standalone lets torchrun pick a free port itself, so none is ever taken."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            *job_args(project, *extra)[1:]]  # the job's command line without the interpreter


def on_ranks(args: list[Any], nproc: int = 2) -> list[Any]:
    """The command line `args` (a role's, see `role_args`) run on `nproc` ranks by torchrun (--standalone:
    it picks a free port itself)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc, *args[1:]]


def child_env() -> dict[str, str]:
    """This environment without launcher variables, with one thread and a 60 s collective timeout."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", FITTRAIN_COLLECTIVE_TIMEOUT="60", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


# ===================================================================== the parent's side
class Child:
    """A subprocess in a session of its own, writing to a log file, with a deadline for its group.

    Args:
        args: The command line.
        log: The file that receives its stdout and stderr.
        timeout: Seconds from its start after which `wait` kills its whole process group.
    """

    def __init__(self, args: list[Any], log: pathlib.Path, timeout: float = JOB_TIMEOUT_S) -> None:
        self.log, self.timeout, self.started = log, timeout, time.monotonic()
        self.hung = False
        self._swept = False  # its group got SIGKILL: empty, so its id is never signalled again
        self.mark = uuid.uuid4().hex
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**child_env(), _MARK: self.mark}, start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self) -> int | None:
        """Its exit code (negative: the signal that killed it), or None when it ran past its deadline."""
        try:
            return self.proc.wait(timeout=max(self.timeout - (time.monotonic() - self.started), 0.1))
        except subprocess.TimeoutExpired:
            self.hung = True
            self.kill()
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to its whole process group (torchrun's workers too); after SIGKILL, reaps it."""
        if self._swept:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self._swept = True
            self.sweep()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)

    def sweep(self) -> None:
        """SIGKILLs every live process it started that left its process group (torchrun's workers)."""
        wanted = f"{_MARK}={self.mark}".encode()
        for entry in pathlib.Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON events it has printed so far (complete lines only: it may be writing the last one)."""
        lines = self.output().split("\n")[:-1]
        return [json.loads(line[len(EVENT):]) for line in lines if line.startswith(EVENT)]

    def ending(self) -> str:
        """How it ended, with the last line it printed (for a traceback: the error)."""
        code = self.wait()
        lines = [line.strip() for line in self.output().splitlines() if line.strip() and not line.startswith(EVENT)]
        last = f": {lines[-1][:240]}" if lines else ""
        if self.hung:
            return f"hung (killed after {self.timeout:.0f} s){last}"
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}{last}"
        return f"exited {code}{last}"


@contextlib.contextmanager
def killed_after(*children: Child) -> Iterator[None]:
    """Kills `children` (their whole groups) when the block ends, however it ends."""
    try:
        yield
    finally:
        for child in children:
            child.kill()


def wait_until(condition: Callable[[], bool], child: Child, timeout: float = 60.0) -> bool:
    """Polls `condition` until it holds; False when `child` ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if not child.running() or time.monotonic() > deadline:
            return condition()
        time.sleep(0.005)
    return True


class Context:
    """Shared by the categories: the temporary folder, options, random delays, and every child started."""

    def __init__(self, tmp: pathlib.Path, quick: bool, rng: random.Random) -> None:
        self.tmp, self.quick, self.rng = tmp, quick, rng
        self.children: list[Child] = []
        self._references: dict[str, tuple[Child, pathlib.Path]] = {}
        self._count = 0

    def folder(self, name: str) -> pathlib.Path:
        """A new, empty folder for a scenario or a child, numbered in the order of creation."""
        self._count += 1
        path = self.tmp / f"{self._count:03d}-{name}"
        path.mkdir()
        return path

    def start(self, args: list[Any], log: pathlib.Path, timeout: float = JOB_TIMEOUT_S) -> Child:
        child = Child(args, log, timeout)
        self.children.append(child)
        return child

    def kill_all(self, but_references: bool = False) -> None:
        """Kills every child still running (except the uninterrupted runs, with `but_references`)."""
        keep = {id(child) for child, _ in self._references.values()} if but_references else set()
        for child in self.children:
            if id(child) not in keep:
                if child.running():
                    child.kill()
                child.sweep()  # workers may outlive their launcher

    def start_reference(self, kind: str) -> None:
        """Starts the uninterrupted run of `kind` ("single" or "ddp") in the background, once."""
        if kind in self._references:
            return
        run = self.folder(f"reference-{kind}")
        result = run / "result.safetensors"
        args = (job_args(run / "project", "--result", result) if kind == "single"
                else torchrun_args(run / "project", "--epochs", SIGTERM_EPOCHS, "--result", result))
        self._references[kind] = (self.start(args, run / "log"), result)

    def reference(self, kind: str) -> tuple[pathlib.Path | None, str]:
        """The final weights of the uninterrupted run, or None and why there are none."""
        self.start_reference(kind)
        child, result = self._references[kind]
        if child.wait() != 0 or not result.exists():
            return None, f"no reference: the uninterrupted run {child.ending()}"
        return result, ""


# ===================================================================== the child's side
def emit(**fields: Any) -> None:
    """In a child: reports `fields` to the parent as one event line."""
    print(EVENT + json.dumps(fields), flush=True)


def wait_for_file(path: str | None) -> None:
    """In a child: waits until `path` exists (the parent's go signal), at most JOB_TIMEOUT_S."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(0.01)
