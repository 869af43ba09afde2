"""The test harness itself (tests/support/jobs.py): a job whose test fails never outlives it.

The job is the resume suite's training script waiting for a file (scripts/train_job.py --wait-for).
"""

from __future__ import annotations

import os
import pathlib

import pytest

from support.jobs import Job, python_script

pytestmark = pytest.mark.subprocess


def train_job(*args: object) -> list[str]:
    return python_script("train_job.py", *args)


def test_a_job_waiting_for_a_file_that_never_comes_gives_up(tmp_path: pathlib.Path) -> None:
    job = Job(train_job("--wait-for", tmp_path / "never", "--wait-timeout", "0.5", "--project", tmp_path))
    job.wait(expect=1)
    assert "did not appear within 0.5 s" in job.output


def test_a_job_past_its_deadline_shows_where_each_process_was(tmp_path: pathlib.Path) -> None:
    """A hung job's failure says where it hung: SIGABRT before SIGKILL, and faulthandler prints the stacks."""
    job = Job(train_job("--wait-for", tmp_path / "never", "--project", tmp_path), timeout=8)
    with pytest.raises(pytest.fail.Exception) as info:
        job.wait()
    message = str(info.value)
    assert "ran past 8s and was killed" in message
    assert "(most recent call first)" in message and "train_job.py" in message, message[-2000:]


def test_leftover_jobs_are_killed_with_their_whole_group(tmp_path: pathlib.Path) -> None:
    job = Job(train_job("--wait-for", tmp_path / "never", "--project", tmp_path))
    assert job.running()
    Job.kill_leftovers()  # what the suite's guard does after every test
    assert not job.running()
    try:
        os.killpg(job.pid, 0)
    except ProcessLookupError:
        pass  # the group is gone: nothing of the job is left
    else:
        raise AssertionError(f"process group {job.pid} still has members")
