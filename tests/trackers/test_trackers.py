"""The Accelerator's tracker API (Accelerate's): log_with, init_trackers, log, get_tracker, end_training.

What the built-in trackers wrote is read back with each format's own reader: tensorboard's
`EventAccumulator` (scalars, text, the hparams plugin), and the csv and json modules.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from fittrain import Accelerator, ProjectConfiguration
from fittrain.trackers import (
    CSVTracker,
    GeneralTracker,
    JSONLTracker,
    LoggerType,
    NoOpTracker,
    TensorBoardTracker,
    resolve_trackers,
)


class ListTracker(GeneralTracker):
    """A custom tracker that keeps what it receives."""

    name = "list"

    def __init__(self) -> None:
        self.logged, self.config, self.finished = [], None, False

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values), kwargs))

    def finish(self):
        self.finished = True


def test_init_trackers_log_and_end_training_write_every_format(tmp_path):
    custom = ListTracker()
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["tensorboard", LoggerType.CSV, "jsonl", custom])
    acc.init_trackers("exp1", config={"lr": 0.1, "model": {"depth": 2}, "note": None})
    for step in (1, 2):
        acc.log({"loss": 1.0 / step, "acc": torch.tensor(0.5 * step)}, step=step, log_kwargs={"list": {"tag": "x"}})
    acc.log({"comment": "hello"}, step=3)
    acc.end_training()
    run = tmp_path / "exp1"
    events = EventAccumulator(str(run))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("acc")] == [(1, 0.5), (2, 1.0)]
    assert "comment" in events.Tags()["tensors"]  # strings are text summaries
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)[hparams_metadata.SESSION_START_INFO_TAG]
    hparams = hparams_metadata.parse_session_start_info_plugin_data(content).hparams
    assert hparams["lr"].number_value == pytest.approx(0.1) and hparams["model/depth"].number_value == 2
    assert hparams["note"].string_value == "None"
    with open(run / "metrics.csv", newline="") as f:
        rows = [(r["step"], r["name"], r["value"]) for r in csv.DictReader(f)]
    assert rows == [("1", "loss", "1.0"), ("1", "acc", "0.5"), ("2", "loss", "0.5"), ("2", "acc", "1.0"),
                    ("3", "comment", "hello")]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["values"]) for line in lines] == [
        (1, {"loss": 1.0, "acc": 0.5}), (2, {"loss": 0.5, "acc": 1.0}), (3, {"comment": "hello"})]
    assert json.loads((run / "hparams.json").read_text()) == {"lr": 0.1, "model/depth": 2, "note": "None"}
    assert custom.config == {"lr": 0.1, "model": {"depth": 2}, "note": None} and custom.finished
    assert custom.logged[0][2] == {"tag": "x"} and custom.logged[2][2] == {}
    assert acc.trackers == []  # end_training finished and let go of them


def test_get_tracker_returns_the_tracker_or_its_underlying_object(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["tensorboard", "csv", "jsonl"])
    acc.init_trackers("exp", init_kwargs={"tensorboard": {"flush_secs": 1}})
    assert [t.name for t in acc.trackers] == ["tensorboard", "csv", "jsonl"]
    assert isinstance(acc.get_tracker("tensorboard"), TensorBoardTracker)
    writer = acc.get_tracker("tensorboard", unwrap=True)
    writer.add_scalar("extra", 3.0, 7)  # a torch SummaryWriter on the same run folder
    assert isinstance(acc.get_tracker("csv"), CSVTracker) and isinstance(acc.get_tracker("jsonl"), JSONLTracker)
    with pytest.raises(ValueError, match=r"get_tracker\('nope'\): no open tracker has that name"):
        acc.get_tracker("nope")
    acc.end_training()
    events = EventAccumulator(str(tmp_path / "exp"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("extra")] == [(7, 3.0)]


def test_all_means_accelerates_trackers_whose_package_is_installed():
    # Accelerate's "all" has no csv or jsonl (it has no such trackers): they are opened only when named.
    installed = [n for n in ("wandb", "mlflow") if importlib.util.find_spec(n)]
    assert [spec.name for spec in resolve_trackers("all")] == ["tensorboard", *installed]
    names = [spec.name for spec in resolve_trackers(["csv", "all", LoggerType.CSV])]
    assert names == ["csv", "tensorboard", *installed]  # in order, without duplicates


def test_trackers_write_where_accelerate_writes(tmp_path):
    """`Accelerator(project_dir=P)`: logging_dir is P, and init_trackers(name) writes P/name, with
    only the trackers named in log_with (no csv or jsonl beside TensorBoard's events)."""
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="tensorboard")
    acc.init_trackers("exp", config={"lr": 0.1})
    acc.log({"loss": 0.5}, step=1)
    acc.end_training()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]
    files = [p.name for p in (tmp_path / "exp").iterdir()]
    assert files and all(name.startswith("events.out.tfevents.") for name in files)
    events = EventAccumulator(str(tmp_path / "exp"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5)]

    elsewhere = tmp_path / "tb"  # an explicit logging_dir wins, as in Accelerate
    acc = Accelerator(cpu=True, log_with="tensorboard", project_config=ProjectConfiguration(logging_dir=str(elsewhere)))
    acc.init_trackers("exp2")
    acc.end_training()
    assert (elsewhere / "exp2").is_dir()


def test_steps_default_to_the_next_one(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    acc.init_trackers("exp")
    for value in (1.0, 2.0, 3.0):
        acc.log({"x": value})
    acc.end_training()
    with open(tmp_path / "exp" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]


def test_other_processes_get_no_op_trackers(tmp_path, monkeypatch):
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with=["tensorboard", "csv"])
    acc.init_trackers("exp", config={"lr": 0.1})
    acc.log({"loss": 1.0}, step=1)
    assert all(isinstance(t, NoOpTracker) for t in acc.trackers)
    acc.get_tracker("tensorboard", unwrap=True).add_histogram("w", torch.zeros(3), 1)  # absorbed
    acc.end_training()
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("log_with, error, match", [
    ("tb", ValueError, r"unknown tracker\. Received: 'tb'\. Accepted: 'all', 'tensorboard', 'wandb', 'mlflow', "
                       r"'csv', 'jsonl'"),
    (["csv", 5], TypeError, r"Received: 5 \(int\)"),
    (CSVTracker, TypeError, r"Received: <class"),
])
def test_bad_log_with_is_refused_when_the_accelerator_is_built(log_with, error, match):
    with pytest.raises(error, match=match):
        Accelerator(cpu=True, log_with=log_with)


def test_init_trackers_without_a_logging_folder_names_project_dir(tmp_path):
    acc = Accelerator(cpu=True, log_with=["csv", ListTracker()])
    with pytest.raises(ValueError, match=r"init_trackers\(\) needs a logging folder for csv.*project_dir="):
        acc.init_trackers("exp")
    acc = Accelerator(cpu=True, log_with=ListTracker(),
                      project_config=ProjectConfiguration(logging_dir=str(tmp_path / "elsewhere")))
    acc.init_trackers("exp")  # a tracker without files needs no folder
    assert acc.get_tracker("list", unwrap=True) == []


def test_init_kwargs_for_a_tracker_not_in_use_are_refused(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    with pytest.raises(ValueError, match=r"name no tracker in use: \['wandb'\]"):
        acc.init_trackers("exp", init_kwargs={"wandb": {"entity": "me"}})
    with pytest.raises(TypeError, match=r"project_name=5"):
        acc.init_trackers(5)


def test_unloggable_values_name_the_metric(tmp_path):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    acc.init_trackers("exp")
    with pytest.raises(TypeError, match=r"cannot record 'weights': its value is a list"):
        acc.log({"weights": [1, 2]}, step=1)
    acc.end_training()


@pytest.mark.parametrize("step, shown", [("x", "step='x'"), (-1, "step=-1"), (1.5, "step=1.5"), (True, "step=True")])
def test_log_refuses_a_step_that_is_not_a_count(tmp_path, step, shown):
    acc = Accelerator(cpu=True, project_dir=tmp_path, log_with="csv")
    acc.init_trackers("exp")
    with pytest.raises(ValueError, match=r"`log\(step=\.\.\.\)` must be an int >= 0 or None.*Received: "
                       + re.escape(shown)):
        acc.log({"x": 1.0}, step=step)
    acc.log({"x": 1.0}, step=np.int64(3))  # numpy's integers are counts too
    acc.end_training()
