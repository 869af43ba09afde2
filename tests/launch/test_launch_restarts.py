"""`fittrain launch --max_restarts`: a worker killed mid-run is restarted with the others by torchrun's
agent, and a script with `resume_from="auto"` goes on from its newest intact checkpoint, ending
bitwise equal to a run that was never interrupted (so every sample after that checkpoint was
trained exactly once more, and none before it again)."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest
import torch

from support.jobs import JOB_TIMEOUT, Job, fittrain_launch, run

pytestmark = pytest.mark.subprocess

#: 48 samples, 2 per process and step on 2 processes: 12 steps an epoch, 24 in 2 epochs; a
#: checkpoint every 4 steps. The ranks wait after step 10, where rank 1 is killed: the newest
#: checkpoint then is step 8's.
ARGS = ("--samples", "48", "--checkpoint-every", "4", "--resume", "auto")
PAUSE_AT, RESUMED_AT, TOTAL = 10, 8, 24


def _wait_for(paths: list[pathlib.Path], job: Job) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(p.exists() for p in paths):
        assert job.running(), f"the job ended before every rank paused:\n{job.output[-4000:]}"
        assert time.monotonic() < deadline, "the ranks never paused"
        time.sleep(0.05)


def test_a_killed_worker_is_restarted_and_the_run_resumes_from_its_newest_checkpoint(tmp_path: pathlib.Path) -> None:
    reference = tmp_path / "reference.pt"
    run(fittrain_launch(2, "slurm_train.py", *ARGS, "--project", tmp_path / "whole", "--result", reference)).check()

    project, result = tmp_path / "job", tmp_path / "result.pt"
    job = Job(fittrain_launch(2, "slurm_train.py", *ARGS, "--project", project, "--result", result,
                              "--pause-at-step", PAUSE_AT, launch_args=("--max_restarts", "1")))
    try:
        paused = [project / f"paused.rank{rank}" for rank in (0, 1)]
        _wait_for(paused, job)
        (project / "restarted").touch()  # the restarted ranks do not pause again
        os.kill(int(paused[1].read_text()), signal.SIGKILL)
        done = job.wait(expect=0)
    finally:
        job.kill_group()
    assert "resume_from='auto': nothing saved under" in done.output  # the first attempt started afresh
    assert f"checkpoint_{RESUMED_AT // 4 - 1}: epoch 0, optimizer step {RESUMED_AT}" in done.output, done.output[-4000:]
    expected, actual = torch.load(reference, weights_only=True), torch.load(result, weights_only=True)
    assert sorted(actual) == sorted(expected)
    assert all(torch.equal(actual[k], expected[k]) for k in expected), "the restarted run differs bitwise"
