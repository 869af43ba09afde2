"""Session fixtures for the distributed tests: each expensive launch runs once and is shared.

Jobs are expensive on a small machine, so one launch checks many things (see scripts/), and the
fixtures below share each launch between the tests that read it. See tests/support/jobs.py for how
a job runs.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest
import torch

from support.jobs import fittrain_launch, forked, load_script, run
from support.results import read_results


@pytest.fixture(scope="session")
def training() -> ModuleType:
    """The model, data and loop that the workers use (scripts/training.py)."""
    return load_script("training")


@pytest.fixture(scope="session")
def references(training: ModuleType) -> dict[str, dict[str, torch.Tensor]]:
    """Each of training.RUNS on one process (this one) with twice the per-process batch.

    With shuffle seeded identically, a 2-process run with batch B gives rank r the samples
    [2B*k + r*B, 2B*k + (r+1)*B) of round k, which is exactly batch k of a 1-process loader with
    batch 2B over the same order; gradients averaged over ranks then equal the 2B-batch mean.
    """
    from fittrain import Accelerator

    assert "WORLD_SIZE" not in os.environ, "the references must run on one process"
    return {name: training.train(Accelerator(gradient_accumulation_steps=accumulation), 2 * batch, n)
            for name, (batch, n, accumulation) in training.RUNS.items()}


@pytest.fixture(scope="session")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/ddp_worker.py on 2 processes, through `python -m fittrain launch --strategy ddp`,
    with extra script arguments that must reach the script untouched."""
    out = tmp_path_factory.mktemp("ddp")
    job = run(fittrain_launch(2, "ddp_worker.py", "--out", str(out), "--lr", "0.5", "--flag",
                              launch_args=("--strategy", "ddp"))).check()
    return {"job": job, "ranks": read_results(out, 2), "out": out}


@pytest.fixture(scope="session")
def fsdp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scripts/fsdp_worker.py on 2 processes, through plain torchrun."""
    out = tmp_path_factory.mktemp("fsdp")
    job = run(forked(2, "fsdp_worker.py", "--out", str(out))).check()
    return {"job": job, "ranks": read_results(out, 2), "out": out}
