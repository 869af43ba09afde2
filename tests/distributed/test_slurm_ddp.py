"""A simulated SLURM job step: 2 plain `python scripts/slurm_train.py` processes (no torchrun),
each with only SLURM's variables, as `srun --ntasks=2` would start them.

They find each other from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST and a port
(MASTER_PORT, or derived from SLURM_JOB_ID), train with the Trainer and save. Then a preemption:
SIGUSR1 to both makes them save and exit 75, and the main process requeues the job through a
fake `scontrol` first on PATH; the requeued step resumes from "latest" and ends bitwise equal to
the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import time
from typing import Any

import pytest
import torch

from fittrain.checkpoint.run_folders import run_checkpoints
from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE
from fittrain.distributed.slurm import PORT_BASE
from support.jobs import JOB_TIMEOUT, Finished, Job, free_port, job_env, python_script

pytestmark = pytest.mark.subprocess

# 48 samples, batch 2 per process, 2 processes: 12 optimizer steps per epoch, 24 in 2 epochs.
TOTAL_STEPS = 24
# The ranks agree on a stop every 10 steps (PreemptionWatcher.check_every): step 10 is mid-epoch 0.
STOP_STEP = 10


def _slurm_env(rank: int, job_id: int, port: int | None, path_prefix: pathlib.Path | None = None,
               **extra: str) -> dict[str, str]:
    """What srun gives task `rank` of a 2-task step on this one node ("localhost")."""
    env = job_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NODELIST="localhost",
                  SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID=str(job_id), **extra)
    if port is not None:
        env["MASTER_PORT"] = str(port)
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return env


class _Step:
    """The 2 tasks of one job step, started together; `kill` ends whatever is left of them. The
    tasks share one port, so a port lost to another process is not retried here (see `uninterrupted`)."""

    def __init__(self, args: list[Any], envs: list[dict[str, str]]) -> None:
        self.tasks = [Job(python_script("slurm_train.py", *args), env, port_retry=False) for env in envs]

    def finish(self, expect: int | None = 0) -> list[Finished]:
        done = [task.wait(expect=None) for task in self.tasks]
        for rank, task in enumerate(done):
            if expect is not None and task.returncode != expect:
                pytest.fail(f"task {rank} exited {task.returncode}, expected {expect}:\n"
                            + "\n".join(f"--- task {r} ---\n{t.output[-3000:]}" for r, t in enumerate(done)))
        return done

    def kill(self) -> None:
        for task in self.tasks:
            task.kill_group()


def _run_step(args: list[Any], envs: list[dict[str, str]], expect: int = 0) -> list[Finished]:
    step = _Step(args, envs)
    try:
        return step.finish(expect)
    finally:
        step.kill()


def _port_for_a_job_id() -> tuple[int, int]:
    """A job id whose derived port (PORT_BASE + its last 4 digits) was free a moment ago."""
    for _ in range(100):
        port = random.randrange(PORT_BASE, PORT_BASE + 10000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 7_770_000 + port - PORT_BASE, port
    pytest.skip("no free port in SLURM's derived range")


def _load(result: pathlib.Path) -> dict[str, torch.Tensor]:
    return torch.load(result, weights_only=True)


def test_localhost_resolves_to_a_loopback_address() -> None:
    assert socket.gethostbyname("localhost").startswith("127.")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole run on a derived port (no MASTER_PORT), saving every 8 steps."""
    out = tmp_path_factory.mktemp("slurm_uninterrupted")
    args = ["--project", out / "run", "--result", out / "result.pt", "--facts", str(out / "facts{rank}.json"),
            "--checkpoint-every", "8"]
    for attempt in range(2):  # the derived port was free a moment ago; another process may take it
        job_id, port = _port_for_a_job_id()
        step = _Step(args, [_slurm_env(rank, job_id, port=None) for rank in (0, 1)])
        try:
            done = step.finish(expect=None)
        finally:
            step.kill()
        # Retried here, not by the runner: the port derives from the job id, which both tasks share.
        if all(task.returncode == 0 for task in done) or attempt or "EADDRINUSE" not in done[0].output:
            break
    for rank, task in enumerate(done):
        assert task.returncode == 0, f"task {rank}:\n{task.output[-4000:]}"
    facts = [json.loads((out / f"facts{rank}.json").read_text()) for rank in (0, 1)]
    return {"out": out, "facts": facts, "port": port}


def test_srun_tasks_find_each_other_from_slurm_variables(uninterrupted: dict[str, Any]) -> None:
    for rank, facts in enumerate(uninterrupted["facts"]):
        assert facts["rank"] == rank and facts["local_rank"] == rank
        assert facts["world_size"] == 2 and facts["backend"] == "gloo" and facts["distributed_type"] == "MULTI_CPU"
        assert facts["all_reduce_sum"] == 3.0  # 1 + 2: both ranks took part
    out = uninterrupted["out"]
    assert json.loads((out / "result.pt.json").read_text())["global_step"] == TOTAL_STEPS
    assert len(run_checkpoints(out / "run")) == TOTAL_STEPS // 8


def test_sigusr1_saves_requeues_once_and_the_requeued_step_resumes_exactly(
        uninterrupted: dict[str, Any], tmp_path: pathlib.Path) -> None:
    bin_dir, log, project = tmp_path / "bin", tmp_path / "scontrol.log", tmp_path / "run"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    (bin_dir / "scontrol").chmod(0o755)
    job_id, port = 4321, free_port()
    step = _Step(["--project", project, "--hold-at-step", STOP_STEP],
                 [_slurm_env(rank, job_id, port, bin_dir) for rank in (0, 1)])
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not all((project / f"held.rank{rank}").exists() for rank in (0, 1)):
            if time.monotonic() > deadline or any(not task.running() for task in step.tasks):
                step.kill()
                pytest.fail("the tasks never reached the step to preempt:\n"
                            + "\n".join(task.output[-3000:] for task in step.tasks))
            time.sleep(0.05)
        for task in step.tasks:
            task.kill(signal.SIGUSR1)  # SLURM's --signal=USR1@90 reaches every task
        first = step.finish(expect=PREEMPTION_EXIT_CODE)
    finally:
        step.kill()
    assert "Preempted: saved" in first[0].output and f"Requeued SLURM job {job_id}" in first[0].output
    assert log.read_text().splitlines() == [f"requeue {job_id}"]  # once, by the main process only
    saved = run_checkpoints(project)
    assert len(saved) == 1
    assert torch.load(saved[0] / "custom_checkpoint_0.pt", weights_only=True)["global_step"] == STOP_STEP

    # The requeued job: the same step, started again, resuming from "latest".
    result, port = tmp_path / "resumed.pt", free_port()
    _run_step(["--project", project, "--resume", "latest", "--result", result],
              [_slurm_env(rank, job_id, port, bin_dir) for rank in (0, 1)])
    assert json.loads(pathlib.Path(f"{result}.json").read_text())["global_step"] == TOTAL_STEPS
    expected = _load(uninterrupted["out"] / "result.pt")
    actual = _load(result)
    assert sorted(actual) == sorted(expected)
    assert all(torch.equal(actual[k], expected[k]) for k in expected), "the resumed run differs bitwise"
    assert log.read_text().splitlines() == [f"requeue {job_id}"]  # a finished job is not requeued
