"""Session fixtures for the distributed tests: each expensive launch runs once and is shared.

Jobs are expensive on a small machine, so one launch checks many things (see tests/support/scripts/),
and the fixtures below share each launch between the tests that read it, on every pytest-xdist
worker (support/shared.py: the tests only read what a job wrote). See tests/support/jobs.py
for how a job runs; the one-process references the jobs are compared with are in
tests/support/training_fixtures.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.jobs import fittrain_launch, forked, run
from support.results import read_results
from support.shared import shared_folder


@pytest.fixture(scope="session")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/ddp_worker.py on 2 processes, through `python -m fittrain launch --strategy ddp`,
    with extra script arguments that must reach the script untouched."""
    out = shared_folder(tmp_path_factory, "ddp", lambda out: run(fittrain_launch(
        2, "ddp_worker.py", "--out", str(out), "--lr", "0.5", "--flag", launch_args=("--strategy", "ddp"))).check())
    return {"ranks": read_results(out, 2), "out": out}


@pytest.fixture(scope="session")
def fsdp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/fsdp_worker.py on 2 processes, through plain torchrun."""
    out = shared_folder(tmp_path_factory, "fsdp",
                        lambda out: run(forked(2, "fsdp_worker.py", "--out", str(out))).check())
    return {"ranks": read_results(out, 2), "out": out}


@pytest.fixture(scope="session")
def hsdp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/hsdp_worker.py on 4 forked processes: HSDP, a 2 x 2 (dp_replicate, dp_shard) mesh."""
    out = shared_folder(tmp_path_factory, "hsdp",
                        lambda out: run(forked(4, "hsdp_worker.py", "--out", str(out))).check())
    return {"ranks": read_results(out, 4), "out": out}


@pytest.fixture(scope="session")
def layouts_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/layouts_worker.py on 4 forked processes: gpt.py's model under DDP, FSDP2, HSDP, TP,
    FSDP2+TP and replication+TP, with checkpoints across layouts."""
    out = shared_folder(tmp_path_factory, "layouts",
                        lambda out: run(forked(4, "layouts_worker.py", "--out", str(out))).check())
    return {"ranks": read_results(out, 4), "out": out}
