"""Logger through trackers: run folders, resume continuing a run, purge of replayed steps, no stale
validation points after a resume, hyperparameters, the validation bar, several optimizers.

Everything written is read back with the readers of each format: tensorboard's own
(`EventAccumulator` applies purge steps as TensorBoard does; `EventFileLoader` shows every raw
event), and the csv and json modules.
"""

from __future__ import annotations

import csv
import json
import pathlib
import re
import types

import pytest
import torch
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from fittrain import Trainer
from fittrain.callbacks import Checkpointer, Logger


def _runs(project: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path for path in (project / "logs").iterdir() if path.is_dir())


def _tensorboard(run: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows it (purged points left out)."""
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _raw_steps(run: pathlib.Path, tag: str) -> list[int]:
    """Every step at which any event file of `run` holds `tag`, duplicates included."""
    steps = []
    for path in sorted(run.glob("events.out.tfevents.*")):
        for event in event_file_loader.EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


def _csv(run: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    table: dict[str, list[tuple[int, float]]] = {}
    with open(run / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            table.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    return table


def _steps(points: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in points]


def _logger(**kwargs) -> Logger:
    return Logger(**{"every_n_steps": 1, "progress_bar": False, **kwargs})


def test_tensorboard_and_csv_hold_the_same_points_in_the_run_folder(make_module, make_loader, tmp_path):
    Trainer(project_dir=tmp_path, max_epochs=2, callbacks=[_logger(log_with=["tensorboard", "csv"])]).fit(
        make_module(), make_loader(), make_loader())
    [run] = _runs(tmp_path)
    assert re.fullmatch(r"run_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run.name)
    board, table = _tensorboard(run), _csv(run)
    assert set(board) == set(table) >= {"train_loss", "val_loss", "lr"}
    for name in ("train_loss", "val_loss", "lr"):
        assert _steps(table[name]) == _steps(board[name])
        assert [v for _, v in table[name]] == pytest.approx([v for _, v in board[name]], rel=1e-6)
    assert _steps(table["val_loss"]) == [4, 8]


def test_each_run_writes_its_own_folder_and_run_name_chooses_it(make_module, make_loader, tmp_path):
    for _ in range(2):
        Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[_logger()]).fit(make_module(), make_loader())
    Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[_logger(run_name="baseline")]).fit(
        make_module(), make_loader())
    runs = _runs(tmp_path)
    assert len(runs) == 3 and (tmp_path / "logs" / "baseline") in runs
    for run in runs:  # one curve per run: no run's folder holds another's points
        assert _steps(_tensorboard(run)["train_loss"]) == [1, 2, 3, 4]


def _train_then_resume(make_module, make_loader, tmp_path, checkpointer, logger_first=True, **logger_kwargs):
    """One epoch, then a resume from its last checkpoint to 2 epochs."""
    for kwargs in ({"max_epochs": 1}, {"max_epochs": 2, "resume_from": "latest"}):
        callbacks = [_logger(**logger_kwargs), checkpointer()]
        Trainer(project_dir=tmp_path, callbacks=callbacks if logger_first else callbacks[::-1], **kwargs).fit(
            make_module(), make_loader(), make_loader())


def test_a_resumed_run_continues_its_folder_without_repeating_a_step(make_module, make_loader, tmp_path):
    # Saved at the end of epoch 0, after its validation: the resumed run replays nothing.
    _train_then_resume(make_module, make_loader, tmp_path, lambda: Checkpointer(every_n_epochs=1),
                       log_with=["tensorboard", "csv"])
    [run] = _runs(tmp_path)
    for tag in ("train_loss", "lr", "val_loss"):
        assert _raw_steps(run, tag) == ([4, 8] if tag == "val_loss" else list(range(1, 9)))
    assert _steps(_csv(run)["train_loss"]) == list(range(1, 9))


@pytest.mark.parametrize("logger_first", [True, False])
def test_no_stale_validation_points_after_a_resume(make_module, make_loader, tmp_path, logger_first):
    # Saved at step 4 before epoch 0's validation, which the resumed run runs again at step 4 (with
    # the Logger after the Checkpointer, step 4's training point too is due after the save). Before
    # the fix, val_loss restored from the checkpoint was also written again at steps 5, 6, 7 and 8.
    _train_then_resume(make_module, make_loader, tmp_path, lambda: Checkpointer(every_n_steps=2), logger_first,
                       log_with=["tensorboard", "csv"])
    [run] = _runs(tmp_path)
    for points in (_tensorboard(run), _csv(run)):
        assert _steps(points["val_loss"]) == [4, 8]
        assert _steps(points["train_loss"]) == _steps(points["lr"]) == list(range(1, 9))


class _Attempt:
    """A metric that says which run wrote a point: 1 before the crash, 2 after the resume."""

    def __init__(self, module, attempt: int) -> None:
        original = module.training_step

        def step(batch):
            module.log("attempt", float(attempt))
            return original(batch)

        module.training_step = step


def test_points_written_after_the_checkpoint_are_replaced_by_the_resumed_run(make_module, make_loader, tmp_path):
    crashed = make_module()
    _Attempt(crashed, 1)
    original = crashed.training_step

    def crash(batch):  # steps 1..5 are logged; the newest checkpoint is at step 4
        if crashed.global_step == 5:
            raise RuntimeError("crash")
        return original(batch)

    crashed.training_step = crash
    logger = dict(log_with=["tensorboard", "csv", "jsonl"])
    with pytest.raises(RuntimeError, match="crash"):
        Trainer(project_dir=tmp_path, max_epochs=2, callbacks=[_logger(**logger), Checkpointer(every_n_steps=2)]).fit(
            crashed, make_loader())
    [run] = _runs(tmp_path)
    assert _steps(_csv(run)["attempt"]) == [1, 2, 3, 4, 5]
    resumed = make_module()
    _Attempt(resumed, 2)
    Trainer(project_dir=tmp_path, max_epochs=2, resume_from="latest",
            callbacks=[_logger(**logger), Checkpointer(every_n_steps=2)]).fit(resumed, make_loader())
    assert _runs(tmp_path) == [run]
    expected = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0), (7, 2.0), (8, 2.0)]
    assert _tensorboard(run)["attempt"] == expected  # TensorBoard drops the crashed run's step 5
    assert sorted(_raw_steps(run, "attempt")) == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # which is still on disk
    assert _csv(run)["attempt"] == expected
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["values"]["attempt"]) for line in lines] == expected


def test_hyperparameters_of_the_trainer_module_and_logger_are_recorded(make_module, make_loader, tmp_path):
    module = make_module()
    module.hparams = {"lr": 0.1, "hidden": 8}
    Trainer(project_dir=tmp_path, max_epochs=2, callbacks=[_logger(log_with=["tensorboard", "csv"],
                                                                   hparams={"batch_size": 4, "hidden": 16})]).fit(
        module, make_loader())
    [run] = _runs(tmp_path)
    events = EventAccumulator(str(run))
    events.Reload()
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)[hparams_metadata.SESSION_START_INFO_TAG]
    start = hparams_metadata.parse_session_start_info_plugin_data(content)
    assert start.hparams["max_epochs"].number_value == 2
    assert start.hparams["precision"].string_value == "no"
    assert start.hparams["lr"].number_value == pytest.approx(0.1)
    assert start.hparams["hidden"].number_value == 16  # the Logger's hparams win
    assert start.hparams["batch_size"].number_value == 4
    assert "Logger(" in start.hparams["callbacks"].string_value
    stored = json.loads((run / "hparams.json").read_text())
    assert stored["max_epochs"] == 2 and stored["hidden"] == 16 and stored["max_steps"] == "None"


def test_validation_shows_a_transient_bar(make_module, make_loader, tmp_path, capsys):
    Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[Logger(log_with=[])]).fit(
        make_module(), make_loader(), make_loader())
    err = capsys.readouterr().err
    assert "Validation" in err and "4/4" in err
    Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[Logger(log_with=[], progress_bar=False)]).fit(
        make_module(), make_loader(), make_loader())
    assert "Validation" not in capsys.readouterr().err


def test_learning_rates_of_several_optimizers_are_named_by_position():
    a = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    b = torch.optim.Adam([{"params": [torch.zeros(1, requires_grad=True)]},
                          {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.02}], lr=0.01)
    rates = Logger._learning_rates(types.SimpleNamespace(optimizers=[a, b], optimizer=a))
    assert rates == pytest.approx({"lr/opt_0": 0.1, "lr/opt_1": 0.01, "lr/opt_1/group_0": 0.01,
                                   "lr/opt_1/group_1": 0.02})
    assert Logger._learning_rates(types.SimpleNamespace(optimizers=[a], optimizer=a)) == {"lr": 0.1}


@pytest.mark.parametrize("kwargs, error, match", [
    ({"log_with": "tb"}, ValueError, r"Received: 'tb'\. Accepted: 'all', 'tensorboard'"),
    ({"log_with": 3}, TypeError, r"Received: 3 \(int\)"),
    ({"run_name": "a/b"}, ValueError, r"Received: run_name='a/b'"),
    ({"hparams": [1]}, TypeError, r"Received: hparams=\[1\]"),
    ({"init_kwargs": {"wandb": {}}}, ValueError, r"name no tracker in use: \['wandb'\]"),
])
def test_bad_arguments_name_what_was_received(kwargs, error, match):
    with pytest.raises(error, match=match):
        Logger(**kwargs)
