"""Session fixtures for tests in several folders (a plugin: tests/conftest.py's `pytest_plugins`).

The 2-process DDP and FSDP2 jobs (tests/distributed/, tests/launch/) train the model of
scripts/training.py and are compared with the same runs on one process, computed here once.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

from support.jobs import load_script


@pytest.fixture(scope="session")
def training() -> ModuleType:
    """The model, data and loop that the workers use (scripts/training.py)."""
    return load_script("training")


@pytest.fixture(scope="session")
def one_process_references(training: ModuleType) -> dict[str, dict[str, torch.Tensor]]:
    """Each of training.RUNS on one process (this one) with twice the per-process batch.

    With shuffle seeded identically, a 2-process run with batch B gives rank r the samples
    [2B*k + r*B, 2B*k + (r+1)*B) of round k, which is exactly batch k of a 1-process loader with
    batch 2B over the same order; gradients averaged over ranks then equal the 2B-batch mean.
    """
    from fittrain import Accelerator

    assert "WORLD_SIZE" not in os.environ, "the references must run on one process"
    return {name: training.train(Accelerator(gradient_accumulation_steps=accumulation), 2 * batch, n)
            for name, (batch, n, accumulation) in training.RUNS.items()}
