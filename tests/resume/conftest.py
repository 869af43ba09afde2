"""Fixtures of the exact-resume suite; the helpers live in resume_jobs.py."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from resume_jobs import Job, References, load_script


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    refs = References(tmp_path_factory.mktemp("references"))
    yield refs
    if refs.job is not None and refs.job.running():
        refs.job.kill_group()


@pytest.fixture(autouse=True)
def no_leftover_jobs():
    """After each test, kills whatever jobs it started that still run."""
    yield
    Job.kill_leftovers()


@pytest.fixture
def deterministic():
    """Deterministic ops for one in-process test, restored afterwards for the rest of the session."""
    previous = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(scope="session")
def train_job_module() -> ModuleType:
    """scripts/train_job.py imported in this process, for the in-process tests."""
    return load_script("train_job")
