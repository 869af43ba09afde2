"""FSDP2 checkpoints of an optimizer without state (plain SGD) load on 2 gloo processes."""

from __future__ import annotations

import pathlib

import pytest

from support.jobs import forked, run
from support.results import assert_state_equal, read_results

pytestmark = pytest.mark.subprocess


def test_a_stateless_optimizer_resumes_under_fsdp(tmp_path: pathlib.Path) -> None:
    run(forked(2, "fsdp_stateless_worker.py", str(tmp_path))).check()
    rank0, _ = read_results(tmp_path, 2)
    assert rank0["lr"] == 0.1  # the saved hyperparameters are back
    assert_state_equal(rank0["restored"], rank0["saved"])
