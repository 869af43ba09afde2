"""The test harness itself (tests/support/jobs.py): a job whose test fails never outlives it.

The job is the resume suite's training script waiting for a file (scripts/train_job.py --wait-for).
"""

from __future__ import annotations

import os
import pathlib
import re
import time

import pytest

from support import jobs
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
    waiting = tmp_path / "waiting"
    job = Job(train_job("--wait-for", tmp_path / "never", "--announce-wait", waiting, "--project", tmp_path))
    # The deadline falls 2 s after the job starts waiting, however long its imports took: on a busy
    # machine a fixed deadline can fall while it still imports torch.
    deadline = time.monotonic() + 120
    while not waiting.exists():
        assert job.running() and time.monotonic() < deadline, "the job never started waiting"
        time.sleep(0.05)
    job.timeout = time.monotonic() - job.began + 2
    with pytest.raises(pytest.fail.Exception) as info:
        job.wait()
    message = str(info.value)
    assert re.search(r"ran past \d+s and was killed", message), message[:500]
    # Where it hung, innermost frame first: the wait loop in the script's main().
    innermost = re.search(r'\(most recent call first\):\n  File "[^"]*train_job\.py", line \d+ in main', message)
    assert innermost, message[-3000:]


def test_the_failure_message_shows_a_deep_stack_from_its_innermost_frame() -> None:
    """A stack dump longer than the message's share keeps its first lines (the innermost frames, where
    the job hung) and its end, instead of a tail that starts mid-stack."""
    frames = "".join(f'  File "module{i}.py", line {i} in f{i}\n' for i in range(400))
    header = "Current thread 0x1 (most recent call first):"
    stacks = f"{jobs.STACK_DUMP_FIRST_LINE}\n\n{header}\n{frames}Extension modules: x\n"
    output = "step 1\n" * 50 + stacks
    shown = jobs.excerpt(output, limit=3000)
    assert len(shown) < 3100 and shown.startswith(jobs.STACK_DUMP_FIRST_LINE)
    assert f'{header}\n  File "module0.py"' in shown
    assert shown.endswith("Extension modules: x\n") and "characters of stacks left out" in shown
    assert jobs.excerpt("short output") == "short output"
    assert jobs.excerpt("x" * 10_000, limit=3000) == "x" * 3000  # no stacks: the tail


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
