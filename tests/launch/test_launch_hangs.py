"""The hang watchdog (fittrain/distributed/watchdog.py) with real workers under `fittrain launch`:
a rank that stops (SIGSTOP) mid-epoch ends the job within the bound, with a message naming it and
nothing left running; a save (or other one-off work) on one rank that outlasts the bound is not a hang."""

from __future__ import annotations

import os
import pathlib

import pytest

from support.jobs import fittrain_launch, run

pytestmark = pytest.mark.subprocess

#: A short bound keeps most of these tests quick; the default ("auto") is max(60 s, 20 x the median
#: step), whose arithmetic tests/distributed/test_watchdog.py checks, and which the slow test uses.
BOUND = 3.0
#: 96 samples, 2 per process and step: 24 steps an epoch on 2 processes.
ARGS = ("--samples", "96", "--epochs", "1", "--hang-timeout", str(BOUND))
#: The documented default: a tiny model's job ends 60 to 65 s after a rank stops; 2 minutes at most.
DEFAULT_FLOOR, DEFAULT_LIMIT = 60.0, 120.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stopped_rank_job(tmp_path: pathlib.Path, *bound: str) -> tuple[float, str]:
    """Runs a 2-process job whose rank 1 stops itself as step 6 starts; checks that the job failed,
    named rank 1 by its pid, and left it dead. Returns the seconds from the stop to the job's end,
    and the job's output."""
    done = run(fittrain_launch(2, "slurm_train.py", "--samples", "96", "--epochs", "1", *bound,
                               "--project", tmp_path, "--stop-at-step", "6"))
    stopped = int((tmp_path / "stopped.rank1").read_text())
    assert done.returncode != 0, done.output[-3000:]
    assert "rank 0 waited" in done.output and f"rank 1 (pid {stopped} on" in done.output, done.output[-3000:]
    assert "stopped answering" in done.output
    assert not _alive(stopped), "the stopped rank was left behind"
    return done.ended_at - (tmp_path / "stopped.rank1").stat().st_mtime, done.output


def test_a_stopped_rank_ends_the_job_within_the_bound_naming_it(tmp_path: pathlib.Path) -> None:
    took, _ = _stopped_rank_job(tmp_path, "--hang-timeout", str(BOUND))
    # The bound, the staleness of the heartbeat (3 periods of BOUND/4) and the launcher's teardown; the
    # 30-minute collective timeout or torchrun's 30 s wait for a stopped worker would far exceed it.
    assert took < 25, f"the job ended {took:.0f} s after rank 1 stopped"


@pytest.mark.slow
def test_with_the_default_bound_a_stopped_rank_ends_a_tiny_job_within_two_minutes(tmp_path: pathlib.Path) -> None:
    took, output = _stopped_rank_job(tmp_path)  # hang_timeout="auto"
    assert "longer than the hang bound of 60 s" in output, output[-3000:]
    assert DEFAULT_FLOOR <= took < DEFAULT_LIMIT, f"the job ended {took:.0f} s after rank 1 stopped"


def test_slow_work_on_one_rank_outside_the_step_is_not_a_hang(tmp_path: pathlib.Path) -> None:
    # Rank 1 spends 2.5 bounds at the end of step 6 with no collective (rank 0 waits in step 7's
    # all-reduce meanwhile), then as long in its first save (step 8: rank 0 waits in the save's
    # barrier, or in step 9's all-reduce). Its heartbeats say it is busy outside a step: one-off work
    # keeps the long timeout. Each of the two alone ends the job when busy peers count as hung.
    slow = str(2.5 * BOUND)
    done = run(fittrain_launch(2, "slurm_train.py", *ARGS, "--project", tmp_path, "--slow-batch-end", slow,
                               "--checkpoint-every", "8", "--slow-save", slow, "--result", tmp_path / "result.pt"))
    done.check()
    assert "stopped answering" not in done.output and "deadlock" not in done.output
    assert (tmp_path / "result.pt").exists()
