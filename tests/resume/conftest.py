"""Fixtures of the exact-resume suite; its helpers live in resume_support.py.

(Jobs a failing test left running are ended by the suite's guard, tests/conftest.py.)
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterator

import pytest
import torch

from resume_support import References
from support.jobs import load_script


@pytest.fixture(scope="session")
def resume_references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[References]:
    """The uninterrupted runs the resumed ones are compared with, computed once per session."""
    refs = References(tmp_path_factory.mktemp("references"))
    yield refs
    if refs.job is not None and refs.job.running():
        refs.job.kill_group()


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic ops for one in-process test, restored afterwards for the rest of the session."""
    previous = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(scope="session")
def train_job_module() -> ModuleType:
    """scripts/train_job.py imported in this process, for the in-process tests."""
    return load_script("train_job")
