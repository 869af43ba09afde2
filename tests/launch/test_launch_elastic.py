"""An elastic job on two "machines": two `fittrain launch` launchers on this machine meet at a c10d
rendezvous on localhost (`--nnodes 1:2 --nproc_per_node 1 --max_restarts 3`), one process each.
It shrinks (below) and grows (`test_an_elastic_job_grows_when_a_launcher_joins`).

One job goes through both of torchrun's recoveries:

1. a *worker* is killed (SIGKILL) after step 10: both launchers restart their processes, the two
   meet again and `resume_from="auto"` goes on from step 8's checkpoint (2 steps, 8 samples,
   trained again);
2. a *launcher* is killed after step 18 (its worker dies with it): the other launcher restarts its
   process alone, and the run goes on from step 16's checkpoint on one process (2 steps, 8 samples,
   trained again), as elastic resume deals the rest of the epoch.

The final weights must equal, bitwise, those of a reference that never failed: an uninterrupted
2-process run whose step-16 checkpoint is resumed on one process. Equal weights at the end mean
that every sample after each checkpoint was trained exactly once more, and none before it again.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import time

import pytest
import torch

from support.jobs import JOB_TIMEOUT, Job, fittrain_launch, free_port, python_script, run

pytestmark = pytest.mark.subprocess

#: 48 samples, 2 per process and step: 12 steps an epoch on 2 processes, 24 on one; a checkpoint
#: every 4 steps, kept (no total_limit), so the reference can resume from the job's step-16 one.
ARGS = ("--samples", "48", "--checkpoint-every", "4", "--resume", "auto")
WORKER_KILLED_AT, LAUNCHER_KILLED_AT = 10, 18
#: Long enough for the second launcher to join the first round (the round closes as soon as both
#: have joined); it is also how long the surviving launcher waits for company before going on alone.
LAST_CALL = 10


def _elastic(port: int, *script_args: object, last_call: float = LAST_CALL) -> list[str]:
    """One launcher of the elastic job (one process, `--nnodes 1:2`) running slurm_train.py."""
    # A dead launcher is dropped from the rendezvous after 3 missed keep-alives of 1 s (torch's default: 5 s).
    conf = f"last_call_timeout={last_call:g},join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
    return _without_num_processes(fittrain_launch(1, "slurm_train.py", *script_args, launch_args=(
        "--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "elastic",
        "--rdzv_conf", conf, "--max_restarts", "3", "--monitor_interval", "0.5")))


def _assert_same_weights(result: pathlib.Path, expected: pathlib.Path) -> None:
    want, got = torch.load(expected, weights_only=True), torch.load(result, weights_only=True)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "the elastic run differs from the reference bitwise"


def _without_num_processes(args: list[str]) -> list[str]:
    """`fittrain_launch` passes --num_processes; an elastic job counts processes per machine."""
    i = args.index("--num_processes")
    return [*args[:i], "--nproc_per_node", args[i + 1], *args[i + 2:]]


def _wait_for(paths: list[pathlib.Path], *jobs: Job) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(p.exists() for p in paths):
        for job in jobs:
            assert job.running(), f"a launcher ended early:\n{job.wait(expect=None).output[-4000:]}"
        assert time.monotonic() < deadline, f"never saw {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_an_elastic_job_survives_a_killed_worker_then_a_lost_launcher(tmp_path: pathlib.Path) -> None:
    project, result = tmp_path / "job", tmp_path / "result.pt"
    # The reference's uninterrupted 2-process part runs meanwhile: the job mostly waits.
    reference = Job(fittrain_launch(2, "slurm_train.py", *ARGS, "--project", tmp_path / "whole"))
    port = free_port()
    command = _elastic(port, *ARGS, "--project", project, "--result", result,
                       "--pause-at-steps", f"{WORKER_KILLED_AT},{LAUNCHER_KILLED_AT}")
    first = Job(command, port_retry=False)
    try:
        # The first launcher hosts the rendezvous store: the second starts once it listens, and is
        # the one killed later (losing the store's host would end the job, as in torchrun).
        deadline = time.monotonic() + JOB_TIMEOUT
        while not _listening(port):
            assert first.running() and time.monotonic() < deadline, first.wait(expect=None).output[-4000:]
            time.sleep(0.05)
        second = Job(command, port_retry=False)
        try:
            paused = [project / f"paused.step{WORKER_KILLED_AT}.rank{r}" for r in (0, 1)]
            _wait_for(paused, first, second)
            (project / f"restarted.step{WORKER_KILLED_AT}").touch()
            os.kill(int(paused[1].read_text()), signal.SIGKILL)  # a worker dies: both launchers restart theirs

            paused = [project / f"paused.step{LAUNCHER_KILLED_AT}.rank{r}" for r in (0, 1)]
            _wait_for(paused, first, second)
            (project / f"restarted.step{LAUNCHER_KILLED_AT}").touch()
            second.kill()  # a machine is lost: its launcher, and with it its worker
            second.wait(expect=None)
            (project / f"go.step{LAUNCHER_KILLED_AT}").touch()  # the survivor's next collective fails
            done = first.wait(expect=0)
            reference.wait(expect=0)
        finally:
            second.kill_group()
    finally:
        first.kill_group()
        reference.kill_group()  # nothing left to end once it was waited for
    assert "resume_from='auto': nothing saved under" in done.output  # the first round started afresh
    assert "checkpoint_1: epoch 0, optimizer step 8, 8 batches into the epoch" in done.output, done.output[-4000:]
    # On one process the 16 samples of epoch 1 that 4 steps of 2 x 2 consumed are 8 batches of 2.
    assert "checkpoint_3: epoch 1, optimizer step 16, 8 batches into the epoch" in done.output, done.output[-4000:]

    (whole,) = (tmp_path / "whole" / "checkpoints").iterdir()
    expected = tmp_path / "expected.pt"
    run(python_script("slurm_train.py", "--samples", "48", "--project", tmp_path / "switched", "--resume",
                       whole / "checkpoint_3", "--result", expected)).check()
    _assert_same_weights(result, expected)


def test_an_elastic_job_grows_when_a_launcher_joins(tmp_path: pathlib.Path) -> None:
    """One launcher starts alone (after `last_call_timeout=1`); a second one joins after step 10.
    torchrun stops the running worker with SIGTERM, on which the Trainer saves a checkpoint at that
    step, and the two go on together from it: the same final weights, bitwise, as a 2-process run
    resumed from that checkpoint. (With torch's shared rendezvous store the joining launcher would
    wait for its address until it timed out: `fittrain launch` turns the sharing off for a range.)"""
    project, result = tmp_path / "job", tmp_path / "result.pt"
    port = free_port()
    command = _elastic(port, *ARGS, "--project", project, "--result", result, "--pause-at-steps", "10", last_call=1)
    first = Job(command, port_retry=False)
    try:
        _wait_for([project / "paused.step10.rank0"], first)  # training alone, held after step 10
        (project / "restarted.step10").touch()
        second = Job(command, port_retry=False)
        try:
            done = first.wait(expect=0)
            second.wait(expect=0)
        finally:
            second.kill_group()
    finally:
        first.kill_group()
    (run_folder,) = (project / "checkpoints").iterdir()
    # checkpoint_0 and _1 at steps 4 and 8, then the save on torchrun's SIGTERM at step 10.
    assert "checkpoint_2: epoch 0, optimizer step 10" in done.output, done.output[-4000:]
    assert "optimizer step 10, 5 batches into the epoch" in done.output  # 20 samples: 5 batches of 2 x 2
    expected = tmp_path / "expected.pt"
    run(fittrain_launch(2, "slurm_train.py", "--samples", "48", "--project", tmp_path / "grown",
                        "--resume", run_folder / "checkpoint_2", "--result", expected)).check()
    _assert_same_weights(result, expected)
