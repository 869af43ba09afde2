"""Validation and test under FSDP2 on 2 processes whose shares of the loader differ in length
(scripts/fsdp_eval_worker.py): every forward is a collective, so the process that runs out
repeats its last batch, uncounted, until the other is done: in the averaged loss and in a
torchmetrics Metric the module updates."""

from __future__ import annotations

import math

import pytest

from support.jobs import forked, load_script, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


def test_uneven_evaluation_under_fsdp_neither_hangs_nor_counts_a_repeat(tmp_path) -> None:
    run(forked(2, "fsdp_eval_worker.py", "--out", str(tmp_path))).check()
    ranks = read_results(tmp_path, 2)
    reference = load_script("fsdp_eval_worker").evaluate("auto")  # one process, every sample once
    assert reference["world"] == 1
    for rank in ranks:
        assert rank["world"] == 2
        assert math.isclose(rank["validate"]["val_loss"], reference["validate"]["val_loss"], rel_tol=1e-6)
        assert math.isclose(rank["test"]["test_loss"], reference["test"]["test_loss"], rel_tol=1e-6)
        # The Metric's compute(), synced across the processes by torchmetrics.
        for stage, name in (("validate", "mse"), ("test", "test_mse")):
            assert math.isclose(rank[stage][name], reference[stage][name], rel_tol=1e-6), (stage, rank[stage])
