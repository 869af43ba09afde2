"""Logger: TensorBoard scalars read back with tensorboard's own reader, the tqdm bar, switches, ranks."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fittrain import Accelerator, Trainer
from fittrain.callbacks import GradClip, Logger


def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one run under `folder` (each run writes to `folder/<run name>`) as
    {tag: [(step, value), ...]}, read with tensorboard's reader."""
    runs = [path for path in folder.iterdir() if path.is_dir()]
    assert len(runs) == 1, f"expected one run folder under {folder}, found {runs}"
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _event_files(root: pathlib.Path) -> list[pathlib.Path]:
    return list(root.rglob("events.out.tfevents.*"))


def _fit(module, make_loader, tmp_path, logger, max_epochs=2, validate=True, **trainer_kwargs):
    trainer = Trainer(project_dir=tmp_path, max_epochs=max_epochs, callbacks=[logger], **trainer_kwargs)
    trainer.fit(module, make_loader(), make_loader() if validate else None)
    return trainer


def test_tensorboard_has_train_and_val_loss_lr_and_throughput(make_module, make_loader, tmp_path):
    trainer = _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=2, progress_bar=False))
    scalars = _scalars(tmp_path / "logs")
    assert {"train_loss", "val_loss", "lr", "throughput/steps_per_sec", "throughput/samples_per_sec"} <= set(scalars)
    # 2 epochs x 4 batches: a training point every 2 steps, a validation point at the end of each epoch.
    assert [step for step, _ in scalars["train_loss"]] == [2, 4, 6, 8]
    assert [step for step, _ in scalars["val_loss"]] == [4, 8]
    assert scalars["val_loss"][-1][1] == pytest.approx(trainer.state.metrics["val_loss"], rel=1e-6)
    assert scalars["train_loss"][-1][1] == pytest.approx(trainer.state.loss.item(), rel=1e-6)
    assert [value for _, value in scalars["lr"]] == pytest.approx([0.1] * 4)
    steps_per_sec = [value for _, value in scalars["throughput/steps_per_sec"]]
    samples_per_sec = [value for _, value in scalars["throughput/samples_per_sec"]]
    assert all(v > 0 for v in steps_per_sec)
    # Batches of 4 samples, one step per batch: the two rates differ by the batch size.
    assert samples_per_sec == pytest.approx([4 * v for v in steps_per_sec], rel=1e-6)


def test_throughput_in_samples_for_a_list_of_batches(make_module, make_loader, tmp_path):
    batches = list(make_loader())  # ready batches of 4 samples, no DataLoader
    trainer = Trainer(project_dir=tmp_path, max_epochs=1, callbacks=[Logger(every_n_steps=2, progress_bar=False)])
    trainer.fit(make_module(), batches)
    scalars = _scalars(tmp_path / "logs")
    steps_per_sec = [value for _, value in scalars["throughput/steps_per_sec"]]
    samples_per_sec = [value for _, value in scalars["throughput/samples_per_sec"]]
    assert len(steps_per_sec) == 2 and samples_per_sec == pytest.approx([4 * v for v in steps_per_sec], rel=1e-6)


def test_every_metric_is_logged_and_validation_points_are_not_repeated(make_module, make_loader, tmp_path):
    trainer = Trainer(project_dir=tmp_path, max_epochs=2,
                      callbacks=[GradClip(max_norm=10.0), Logger(every_n_steps=1, progress_bar=False)])
    trainer.fit(make_module(), make_loader(), make_loader())
    scalars = _scalars(tmp_path / "logs")
    assert [step for step, _ in scalars["grad_norm"]] == list(range(1, 9))
    assert [step for step, _ in scalars["train_loss"]] == list(range(1, 9))
    assert [step for step, _ in scalars["val_loss"]] == [4, 8]


def test_a_run_shorter_than_every_n_steps_is_still_logged(make_module, make_loader, tmp_path):
    _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=100, progress_bar=False), max_epochs=1,
         validate=False)
    assert [step for step, _ in _scalars(tmp_path / "logs")["train_loss"]] == [4]


def test_one_lr_per_parameter_group(make_module, make_loader, tmp_path):
    module = make_module()
    module.configure_optimizers = lambda: torch.optim.SGD(
        [{"params": module.net[0].parameters()}, {"params": module.net[2].parameters(), "lr": 0.01}], lr=0.1)
    _fit(module, make_loader, tmp_path, Logger(every_n_steps=2, progress_bar=False), validate=False)
    scalars = _scalars(tmp_path / "logs")
    assert scalars["lr"][0][1] == pytest.approx(0.1)
    assert scalars["lr/group_0"][0][1] == pytest.approx(0.1)
    assert scalars["lr/group_1"][0][1] == pytest.approx(0.01)


def test_log_dir_overrides_the_project_folder(make_module, make_loader, tmp_path):
    _fit(make_module(), make_loader, tmp_path, Logger(log_dir=tmp_path / "tb", progress_bar=False))
    assert "val_loss" in _scalars(tmp_path / "tb")
    assert not (tmp_path / "logs").exists()


def test_tensorboard_off_writes_no_event_files(make_module, make_loader, tmp_path):
    _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=1, log_with=[], progress_bar=False))
    assert _event_files(tmp_path) == []


def test_progress_bar_shows_loss_lr_and_rate(make_module, make_loader, tmp_path, capsys):
    _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=2, log_with=[]))
    err = capsys.readouterr().err
    assert "Epoch 0" in err and "Epoch 1" in err and "4/4" in err
    assert "it/s" in err and "loss=" in err and "lr=0.1" in err and "val_loss=" in err
    assert _event_files(tmp_path) == []


def test_progress_bar_off_prints_nothing(make_module, make_loader, tmp_path, capsys):
    _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=1, progress_bar=False))
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    assert _event_files(tmp_path), "TensorBoard stays on"


def test_other_processes_log_nothing(make_module, make_loader, tmp_path, capsys, monkeypatch):
    # Rank 1 of a run: only the main process may write event files or draw a bar.
    monkeypatch.setattr(Accelerator, "is_main_process", property(lambda self: False))
    _fit(make_module(), make_loader, tmp_path, Logger(every_n_steps=1))
    assert _event_files(tmp_path) == []
    assert capsys.readouterr().err == ""


def test_an_exception_closes_the_writer_and_keeps_what_was_logged(make_module, make_loader, tmp_path):
    module = make_module()
    original = module.training_step

    def fail_at_step_3(batch):
        if module.global_step == 3:
            raise RuntimeError("boom")
        return original(batch)

    module.training_step = fail_at_step_3
    logger = Logger(every_n_steps=1, progress_bar=False)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(module, make_loader, tmp_path, logger)
    assert [step for step, _ in _scalars(tmp_path / "logs")["train_loss"]] == [1, 2, 3]
    assert logger.trackers == []  # finished and let go


@pytest.mark.parametrize("kwargs, received", [
    ({"every_n_steps": 0}, "every_n_steps=0"),
    ({"every_n_steps": -5}, "every_n_steps=-5"),
    ({"every_n_steps": 2.0}, "every_n_steps=2.0"),
    ({"every_n_steps": True}, "every_n_steps=True"),
    ({"progress_bar": 1}, "progress_bar=1"),
    ({"log_dir": 5}, "log_dir=5"),
])
def test_bad_arguments(kwargs, received):
    with pytest.raises(ValueError, match=f"Received: {received}"):
        Logger(**kwargs)
