"""The forked-rank runner itself (tests/support/ranks.py): a fresh process, torchrun's environment,
a real gloo group, failures reported and nothing left running."""

from __future__ import annotations

import os
import pathlib

import pytest

from support import ranks as forked_ranks
from support.jobs import SCRIPTS, forked, job_env, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


def test_ranks_see_what_a_torchrun_worker_sees(tmp_path: pathlib.Path) -> None:
    done = run(forked(2, "forked_probe_worker.py", str(tmp_path), "probe", cwd=tmp_path)).check()
    rank0, rank1 = read_results(tmp_path, 2)
    for rank, seen in enumerate((rank0, rank1)):
        assert seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        assert (seen["name"], seen["argv"], seen["cwd"]) == ("__main__", [str(tmp_path), "probe"], str(tmp_path))
        assert (seen["world"], seen["sum"], seen["threads"], seen["start_method"]) == (2, 3.0, 1, "fork")
    assert rank0["random"] != rank1["random"], "forked ranks share the forkserver's random state"
    assert "rank 0 done" in done.output and "rank 1 done" in done.output


def test_a_failing_rank_ends_the_job_with_its_exit_code_and_its_traceback(tmp_path: pathlib.Path) -> None:
    done = run(forked(2, "forked_probe_worker.py", str(tmp_path), "raise"), timeout=120)  # fails the test past it
    assert done.returncode == 1, done.output[-4000:]
    assert "RuntimeError: rank 1 fails on purpose" in done.output


def test_a_job_past_its_deadline_is_killed_with_every_rank(tmp_path: pathlib.Path) -> None:
    job = forked_ranks.Job(SCRIPTS / "forked_probe_worker.py", [str(tmp_path), "hang"], 2, job_env())
    pids = [proc.pid for proc in job.procs]
    try:
        assert not job.wait(timeout=2.0)
    finally:
        job.close()
    assert not job.running()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # each rank led a process group; none of its members is left
