"""Signals to the `fittrain launch` process itself, with 2 gloo workers running a Trainer job.

- SIGTERM (what srun, scancel and docker stop send) makes the workers save and exit 75, and the
  launcher exits 75 too, as it does for SIGUSR1.
- A second SIGTERM hands over to torchrun's own shutdown (SIGTERM, then SIGKILL after its
  timeout), so a job whose script ignores SIGTERM still ends, with 143.
- SIGKILL to the launcher leaves no worker running: torchrun starts each worker in a session of
  its own, so nothing but fittrain's guard (see fittrain/distributed/launch_guard.py) stops them.

Each job holds its ranks after optimizer step 10 (scripts/slurm_train.py's `--hold-at-step`), where
the ranks agree on a stop, so the test signals a job known to be mid-training. Every process a
test starts is killed at its end, whatever happened (`Job.kill_group` finds them by an environment mark).
"""

from __future__ import annotations

import json
import pathlib
import signal
import sys
import time

import pytest
import torch

from fittrain.checkpoint import is_intact
from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE, launcher_signals
from support.jobs import JOB_TIMEOUT, SCRIPTS, Job, job_env

STOP_STEP = 10  # the ranks agree on a stop every 10 steps (PreemptionWatcher.check_every)
#: How long the workers may take to disappear once their launcher is gone (they die at once;
#: the bound only covers a busy machine).
ORPHAN_BOUND_SECONDS = 30.0

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(sys.platform != "linux", reason="signals to process trees; tested on Linux")]
#: torchrun before torch 2.9 has no --signals-to-handle: it keeps SIGTERM to itself and exits 143.
needs_sigterm_forwarding = pytest.mark.skipif(signal.SIGTERM not in launcher_signals(),
                                              reason="this torchrun cannot leave SIGTERM to fittrain launch")


def _launch_command(script: str, *script_args: str) -> list[str]:
    """`fittrain launch` of 2 workers running scripts/`script`. No --main_process_port: on one
    machine torchrun picks a free port itself, so there is no port race."""
    return [sys.executable, "-m", "fittrain", "launch", "--num_processes", "2", str(SCRIPTS / script), *script_args]


def _wait_for_files(job: Job, files: list[pathlib.Path]) -> None:
    """Waits until all `files` exist; kills the job and fails with its output if it ended first."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(f.exists() for f in files):
        if not job.running() or time.monotonic() > deadline:
            job.kill_group()
            pytest.fail(f"{[f.name for f in files]} never all appeared (exit {job.returncode}):\n{job.output[-4000:]}")
        time.sleep(0.05)


def _held_launch(project: pathlib.Path) -> Job:
    """A Trainer job on 2 workers whose ranks hold after step STOP_STEP until a preemption signal;
    returns once both hold."""
    project.mkdir()
    job = Job(_launch_command("slurm_train.py", "--project", str(project), "--samples", "64",
                              "--hold-at-step", str(STOP_STEP), "--facts", str(project / "facts{rank}.json")))
    _wait_for_files(job, [project / f"held.rank{rank}" for rank in (0, 1)])
    return job


def _checkpoints(project: pathlib.Path) -> list[pathlib.Path]:
    """The intact checkpoints anywhere under the project's checkpoints folder (any run layout)."""
    return [p for p in sorted((project / "checkpoints").glob("**/checkpoint_*")) if p.is_dir() and is_intact(p)]


@needs_sigterm_forwarding
def test_sigterm_to_the_launcher_saves_and_exits_75(tmp_path: pathlib.Path) -> None:
    project = tmp_path / "run"
    job = _held_launch(project)
    try:
        job.kill(signal.SIGTERM)  # the launcher only, as srun or docker stop signal it
        job.wait(expect=None)
    finally:
        job.kill_group()
    assert job.returncode == PREEMPTION_EXIT_CODE, job.output[-4000:]
    assert "Preempted: saved" in job.output, job.output[-4000:]
    saved = _checkpoints(project)
    assert len(saved) == 1, saved
    assert torch.load(saved[0] / "custom_checkpoint_0.pt", weights_only=True)["global_step"] == STOP_STEP


@needs_sigterm_forwarding
def test_a_second_sigterm_stops_workers_that_ignore_the_first(tmp_path: pathlib.Path) -> None:
    # torchrun's grace period between its SIGTERM and its SIGKILL, short for the test.
    job = Job(_launch_command("sigterm_worker.py", str(tmp_path)), env=job_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3"))
    try:
        _wait_for_files(job, [tmp_path / f"ready.rank{rank}" for rank in (0, 1)])
        job.kill(signal.SIGTERM)
        _wait_for_files(job, [tmp_path / f"term.rank{rank}" for rank in (0, 1)])  # forwarded, and survived
        job.kill(signal.SIGTERM)
        job.wait(expect=None)
    finally:
        job.kill_group()
    assert job.returncode == 128 + signal.SIGTERM, job.output[-4000:]


def _is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_sigkill_to_the_launcher_leaves_no_worker(tmp_path: pathlib.Path) -> None:
    project = tmp_path / "run"
    job = _held_launch(project)
    try:
        workers = [json.loads((project / f"facts{rank}.json").read_text())["pid"] for rank in (0, 1)]
        assert all(_is_running(pid) for pid in workers), workers
        job.kill()  # SIGKILL to the launcher only; its workers live in sessions of their own
        job.proc.wait(timeout=30)
        deadline = time.monotonic() + ORPHAN_BOUND_SECONDS
        while any(_is_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if _is_running(pid)]
        assert not left, f"workers {left} outlived their launcher by {ORPHAN_BOUND_SECONDS:.0f}s"
    finally:
        job.kill_group()  # every process of the job, workers included, found by its environment mark
