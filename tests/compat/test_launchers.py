"""Accelerate's notebook_launcher and debug_launcher start 2 real processes from Python."""

from __future__ import annotations

import json
import pathlib

import pytest

from fittrain import notebook_launcher
from support.jobs import free_port, python_script, run

pytestmark = pytest.mark.subprocess


def test_both_launchers_run_a_function_on_two_processes(tmp_path: pathlib.Path) -> None:
    run(python_script("launchers_worker.py", tmp_path, free_port())).check()
    for name, precision in (("notebook", "bf16"), ("debug", "no")):
        for rank in (0, 1):
            facts = json.loads((tmp_path / f"{name}_rank{rank}.json").read_text())
            assert facts == {"processes": 2, "precision": precision, "sum": 3.0, "device": "cpu"}


def test_one_process_runs_here_and_bad_counts_are_named() -> None:
    seen = []
    notebook_launcher(seen.append, args=(7,), num_processes=1)
    assert seen == [7]
    with pytest.raises(ValueError, match="`num_processes` must be a positive integer. Received: num_processes=0"):
        notebook_launcher(seen.append, args=(7,), num_processes=0)
