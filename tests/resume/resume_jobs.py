"""Helpers for the exact-resume suite: real training subprocesses and bitwise comparisons.

(A module of its own, not conftest.py, so that `from resume_jobs import ...` is unambiguous
when pytest collects several test folders that each have a conftest.)

Every run that matters happens in a fresh Python process (scripts/train_job.py or
scripts/plain_loop.py). A resumed process seeds every RNG with 999 instead of 0 before it builds
anything, so whatever a checkpoint fails to restore changes the final parameters. Independent
jobs run side by side (the machine has few cores and each job spends most of its time importing
torch), and each job has a deadline after which its whole process group is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

import pytest
import safetensors.torch
import torch

from support import ranks as forked_ranks

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
TRAIN_JOB = SCRIPTS / "train_job.py"
#: Longest a job may take before it is killed: generous, because the machine may be shared.
JOB_TIMEOUT = 180.0
#: The seed of a resumed process: anything not restored from the checkpoint then differs.
OTHER_SEED = "999"
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def job_env() -> dict[str, str]:
    """This environment without launcher variables; one thread per process; unbuffered output."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FITTRAIN_COLLECTIVE_TIMEOUT="60")
    return env


@dataclasses.dataclass(frozen=True)
class Forked:
    """A job forked from the test session's preloaded forkserver (tests/support/ranks.py) instead
    of a new interpreter: `nproc` ranks with torchrun's environment, or (torchrun=False) one
    process exactly like `python script args`. For jobs that are not about launching or signals."""

    nproc: int
    script: pathlib.Path
    args: tuple[str, ...]
    torchrun: bool = True


def forked(nproc: int, script: pathlib.Path, *args: Any) -> Forked:
    """`nproc` ranks of `script args` with torchrun's environment, forked (see `Forked`)."""
    return Forked(nproc, script, tuple(map(str, args)))


def forked_train_job(*args: Any) -> Forked:
    """scripts/train_job.py as a fresh single process, forked (see `Forked`)."""
    return Forked(1, TRAIN_JOB, tuple(map(str, args)), torchrun=False)


class Job:
    """A running job, a subprocess in its own process group or `Forked` ranks, with a deadline.

    Every job started is remembered in `Job.started` until `kill_leftovers` (run after each test
    by an autouse fixture) kills the groups of those still running, so a test that fails half-way
    never leaves workers behind.
    """

    started: list["Job"] = []  # a test helper's registry; the session-wide references job is not in it

    def __init__(self, args: list[Any] | Forked, timeout: float = JOB_TIMEOUT,
                 env: dict[str, str] | None = None) -> None:
        self.forked = args if isinstance(args, Forked) else None
        self.args = [str(a) for a in args] if self.forked is None else [str(self.forked.script), *self.forked.args]
        self.env = env or job_env()
        self.timeout = timeout
        self.output = ""
        self._retried = False
        self._start()
        Job.started.append(self)

    @classmethod
    def kill_leftovers(cls) -> None:
        """Kills the process group of every job started since the last call that still runs."""
        jobs, cls.started = cls.started, []
        for job in jobs:
            if job.running():
                job.kill_group()

    def _start(self) -> None:
        self.started = time.monotonic()
        if self.forked is not None:
            self.proc = forked_ranks.Job(self.forked.script, list(self.forked.args), self.forked.nproc, self.env,
                                         torchrun=self.forked.torchrun)
            return
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)

    def _lost_its_port(self) -> bool:
        # free_port() releases the port before torchrun binds it; on a busy machine another
        # process may take it in between. Such a job never started training: run it again.
        return "EADDRINUSE" in self.output and "--master_port" in self.args

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        if isinstance(self.proc, forked_ranks.Job):
            return self.proc.running()
        return self.proc.poll() is None

    def _wait_forked(self, expect: int | None) -> "Job":
        finished = self.proc.wait(max(self.timeout - (time.monotonic() - self.started), 1.0))
        self.output = self.proc.output()
        self.proc.close()
        if not finished:
            pytest.fail(f"job ran past {self.timeout:.0f}s and was killed: {' '.join(self.args)}\n"
                        f"{self.output[-4000:]}")
        if expect is not None and self.proc.returncode != expect:
            pytest.fail(f"job exited {self.proc.returncode} (expected {expect}): {' '.join(self.args)}\n"
                        f"{self.output[-6000:]}")
        return self

    def wait(self, expect: int | None = 0) -> "Job":
        """Waits for the end; fails the test on a timeout or, when `expect` is set, another exit code."""
        if isinstance(self.proc, forked_ranks.Job):
            return self._wait_forked(expect)
        left = max(self.timeout - (time.monotonic() - self.started), 1.0)
        try:
            self.output, _ = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.output, _ = self.proc.communicate()
            pytest.fail(f"job ran past {self.timeout:.0f}s and was killed: {' '.join(self.args)}\n"
                        f"{self.output[-4000:]}")
        if self.proc.returncode != 0 and self._lost_its_port() and not self._retried:
            self._retried = True
            at = self.args.index("--master_port") + 1
            self.args[at] = str(free_port())
            self._start()
            return self.wait(expect)
        if expect is not None and self.proc.returncode != expect:
            self.kill_group()  # the main process ended; its workers must not outlive the test
            pytest.fail(f"job exited {self.proc.returncode} (expected {expect}): {' '.join(self.args)}\n"
                        f"{self.output[-6000:]}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the job's main process only (its DataLoader workers notice on their own)."""
        os.kill(self.pid, sig)

    def kill_group(self) -> None:
        if isinstance(self.proc, forked_ranks.Job):
            self.proc.close()
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None or self.proc.stdout and not self.proc.stdout.closed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.communicate(timeout=30)  # reap it and close its pipe


def train_job(*args: Any) -> list[str]:
    """The command line of scripts/train_job.py in a fresh interpreter."""
    return [sys.executable, str(TRAIN_JOB), *map(str, args)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, script: pathlib.Path, *args: Any) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node N --master_port <free> script args`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port()), str(script), *map(str, args)]


def load_params(path: pathlib.Path | str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def load_summary(path: pathlib.Path | str) -> dict[str, Any]:
    return json.loads(pathlib.Path(f"{path}.json").read_text())


def differing(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that are not bitwise equal (all names when the keys differ)."""
    if sorted(actual) != sorted(expected):
        return sorted(set(actual) | set(expected))
    return [k for k in expected if not torch.equal(actual[k], expected[k])]


def assert_bitwise_equal(result: pathlib.Path, reference: pathlib.Path) -> None:
    """The run that wrote `result` ended with exactly the parameters of the one that wrote `reference`."""
    bad = differing(load_params(result), load_params(reference))
    if bad:
        got, want = load_summary(result), load_summary(reference)
        pytest.fail(f"parameters differ bitwise in {bad}.\nresumed run: {got}\nreference:   {want}")
    assert load_summary(result)["global_step"] == load_summary(reference)["global_step"]


def checkpoint_meta(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "accelerator_state.json").read_text())


def load_script(name: str) -> ModuleType:
    """Imports scripts/{name}.py under a private module name."""
    spec = importlib.util.spec_from_file_location(f"fittrain_resume_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class References:
    """Uninterrupted runs, computed once per session by one background process (scripts/references.py).

    References never resume, so they need no fresh process; one process for all of them pays
    for importing torch once. Each configuration runs twice: without any checkpointing, and
    with saves (whose checkpoints the resume tests start from) while running on to the end.
    `done` appears when all have finished, so a test can start its resumed jobs early and let
    them wait for it (`--wait-for`).
    """

    SAVE_STEPS = "7,10"  # mid-epoch 1, and the end of epoch 1 before its validation
    PLAIN_SAVE_STEP = 7

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.done = root / "done"
        self.job: Job | None = None

    def _runs(self) -> list[list[Any]]:
        runs: list[list[Any]] = []
        for workers in (0, 2):
            for name, extra in ((f"single_w{workers}", ()),
                                (f"single_w{workers}_saving", ("--save-steps", self.SAVE_STEPS))):
                runs.append(["train", "--project", self.root / name, "--run-name", name, "--result",
                             self.result(name), "--workers", workers, *extra])
        runs.append(["train", "--project", self.root / "stream_w2", "--result", self.result("stream_w2"),
                     "--stream", "--workers", 2])
        runs.append(["plain", "--result", self.result("plain")])
        runs.append(["plain", "--result", self.result("plain_saving"), "--checkpoint", self.plain_checkpoint,
                     "--save-at-step", self.PLAIN_SAVE_STEP])
        return runs

    @property
    def plain_checkpoint(self) -> pathlib.Path:
        return self.root / "plain_checkpoint"

    def checkpoint(self, name: str, index: int) -> pathlib.Path:
        return self.root / name / "checkpoints" / name / f"checkpoint_{index}"  # the run is named like its project

    def start(self) -> None:
        if self.job is None:
            args: list[Any] = [SCRIPTS / "references.py", self.done]
            for run in self._runs():
                args += [*run, "--then"]
            # Marked as a process that outlives the test that starts it (tests/conftest.py's guard).
            self.job = Job([sys.executable, *map(str, args[:-1])],
                           env={**job_env(), "FITTRAIN_TEST_SESSION_PROCESS": "1"})
            Job.started.remove(self.job)  # shared by the session: its own fixture stops it

    def result(self, name: str) -> pathlib.Path:
        return self.root / f"{name}.safetensors"

    def get(self, name: str) -> pathlib.Path:
        self.start()
        if self.job.proc.returncode is None:
            self.job.wait()
        return self.result(name)
