"""Trackers on 2 processes (scripts/trackers_worker.py): only the main process writes, through the
Accelerator's API and through the Logger; the other holds NoOpTrackers that absorb every call."""

from __future__ import annotations

import csv

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from support.jobs import forked, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


def test_only_the_main_process_writes_trackers(tmp_path) -> None:
    run(forked(2, "trackers_worker.py", "--out", str(tmp_path))).check()
    ranks = read_results(tmp_path, 2)
    assert ranks[0]["held"] == ["TensorBoardTracker", "CSVTracker"]
    assert ranks[1]["held"] == ["NoOpTracker", "NoOpTracker"]
    direct = tmp_path / "direct" / "exp"
    events = EventAccumulator(str(direct))
    events.Reload()
    # Rank 1 logged its rank (1.0) too; only rank 0's zeros arrived, once per step.
    assert [(e.step, e.value) for e in events.Scalars("rank")] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert [(e.step, e.value) for e in events.Scalars("via_writer")] == [(1, 0.0)]
    with open(direct / "metrics.csv", newline="") as f:
        assert [(r["step"], r["value"]) for r in csv.DictReader(f)] == [("1", "0.0"), ("2", "0.0"), ("3", "0.0")]
    # The Trainer used the same Accelerator: the Logger's run folder is beside init_trackers' one.
    assert {"exp", "fit"} <= {p.name for p in (tmp_path / "direct").iterdir()}
    run_folder = tmp_path / "direct" / "fit"
    steps = ranks[0]["steps"]  # 32 samples, batches of 4, 2 processes: 4 steps
    with open(run_folder / "metrics.csv", newline="") as f:
        logged = [int(r["step"]) for r in csv.DictReader(f) if r["name"] == "train_loss"]
    assert logged == list(range(1, steps + 1)) and steps == 4
