"""fittrain.lightning.callbacks next to Lightning's: a Lightning-style Callback's hooks and state,
ModelCheckpoint's names and best paths, EarlyStopping's decisions, LearningRateMonitor's names and rows,
ModelSummary and TQDMProgressBar, and what each refuses."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import pathlib
from typing import Any

import pytest
import torch

import fittrain.lightning as pl
from fittrain.lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning_programs import assert_same, both, floats, loaders, probe_module, trainer_kwargs


def _arguments(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """What each hook of a Lightning-style callback receives."""
    seen: dict[str, Any] = {}

    class Arguments(api.pl.Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            seen.setdefault("setup", []).append((trainer is trainer_, pl_module is module, str(stage.value
                                                  if hasattr(stage, "value") else stage)))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.setdefault("train_batch_start", []).append((len(batch[0]), batch_idx))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.setdefault("train_batch_end", []).append((sorted(outputs), float(outputs["loss"]), batch_idx))

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            seen.setdefault("before_backward", []).append(float(loss))

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen.setdefault("optimizer", []).append(optimizer.param_groups[0]["lr"])

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            seen.setdefault("validation_batch_end", []).append((outputs, batch_idx, dataloader_idx))

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            seen.setdefault("val_metrics", []).append(sorted(trainer.callback_metrics))

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            seen["exception"] = type(exception).__name__

    module = probe_module(api.pl)
    trainer_ = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, callbacks=[Arguments()], logger=False,
                                               enable_checkpointing=False))
    trainer_.fit(module, *loaders())
    return seen


def test_a_lightning_callback_receives_lightnings_arguments(tmp_path: pathlib.Path) -> None:
    records = both(_arguments, tmp_path)
    assert_same(records)
    assert records["fittrain"]["setup"] == [(True, True, "fit")]


class _Counts(pl.Callback):
    """A callback with state of its own and entries it puts into checkpoints."""

    def __init__(self) -> None:
        self.batches = 0
        self.loaded: list[Any] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(("state", dict(state_dict)))
        self.batches = state_dict["batches"]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["epoch_seen"] = trainer.current_epoch

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.loaded.append(("checkpoint", dict(checkpoint)))


def test_a_callbacks_state_and_checkpoint_entries_come_back_on_resume(tmp_path: pathlib.Path) -> None:
    first = _Counts()
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[first], logger=False))
    trainer.fit(probe_module(pl), *loaders())
    assert first.batches == 10
    again = _Counts()
    resumed = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=3, callbacks=[again], logger=False))
    resumed.fit(probe_module(pl), *loaders(), ckpt_path=trainer.checkpoint_callback.best_model_path)
    assert again.loaded == [("state", {"batches": 10}), ("checkpoint", {"epoch_seen": 1})]
    assert again.batches == 15 and resumed.current_epoch == 3


CHECKPOINTS = {
    "default": {},
    "monitored_top_k": {"monitor": "val_loss", "save_top_k": 2, "filename": "{epoch}-{val_loss:.2f}",
                        "save_last": True},
    "every_n_train_steps": {"every_n_train_steps": 3, "save_top_k": -1},
    "every_2_epochs_max": {"every_n_epochs": 2, "monitor": "val_loss", "mode": "max", "save_top_k": 1},
    "dirpath_and_name_without_keys": {"dirpath": "ckpts", "filename": "model-{epoch:02d}",
                                      "auto_insert_metric_name": False, "save_top_k": -1},
    # Validation twice an epoch, or every other epoch: Lightning saves after each validation, not at
    # the epoch's end, so each save holds the weights its val_loss was measured on.
    "after_each_validation": {"monitor": "val_loss", "save_top_k": -1, "filename": "{epoch}-{step}-{val_loss:.4f}",
                              "save_last": True, "trainer": {"val_check_interval": 2}},
    "every_other_validation_epoch": {"monitor": "val_loss", "save_top_k": 2, "trainer": {"check_val_every_n_epoch": 2}},
    "on_train_epoch_end_given": {"save_top_k": -1, "save_on_train_epoch_end": True,
                                 "trainer": {"val_check_interval": 2}},
}


def _checkpoints(options: dict[str, Any]) -> Any:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        arguments = dict(options)
        checkpoint = api.callbacks.ModelCheckpoint(**{k: v for k, v in arguments.items() if k != "trainer"})
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=4, callbacks=[checkpoint],
                                                  **arguments.get("trainer", {})))
        module = probe_module(api.pl)
        trainer.fit(module, *loaders())

        def rel(path: str) -> str:
            return os.path.relpath(path, root) if path else path
        folder = pathlib.Path(checkpoint.dirpath)
        return {"files": sorted(p.name for p in folder.iterdir() if p.name != "saves.json"),
                "dirpath": rel(str(folder)), "best": rel(checkpoint.best_model_path),
                "best_score": None if checkpoint.best_model_score is None else float(checkpoint.best_model_score),
                "last": rel(checkpoint.last_model_path), "kth": rel(checkpoint.kth_best_model_path),
                "best_k": {rel(k): float(v) for k, v in checkpoint.best_k_models.items()},
                "test": trainer.test(dataloaders=loaders()[1], verbose=False)}
    return run


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_model_checkpoint_names_and_best_paths_match_lightnings(name: str, tmp_path: pathlib.Path) -> None:
    records = both(_checkpoints(CHECKPOINTS[name]), tmp_path)
    kept, lightning_kept = records["fittrain"].pop("files"), records["lightning"].pop("files")
    assert_same(records)
    # With a monitor fittrain keeps the newest save beside the k best (a resume continues exactly from
    # it); Lightning keeps the k best only. Otherwise the folders are Lightning's files.
    newest = [name for name in kept if name.startswith("epoch=3-")] if CHECKPOINTS[name].get("monitor") else []
    assert kept == sorted(set(lightning_kept) | set(newest))
    folder = tmp_path / "fittrain" / records["fittrain"]["dirpath"]
    assert all((folder / name).is_dir() for name in kept)  # fittrain's checkpoints are folders


def test_model_checkpoint_refuses_what_fittrain_cannot_honour() -> None:
    for kwargs, message in (({"save_weights_only": True}, "save_weights_only"),
                            ({"train_time_interval": 60}, "train_time_interval"),
                            ({"enable_version_counter": False}, "enable_version_counter"),
                            ({"verbose": True}, "verbose"),
                            ({"save_top_k": 3}, "No quantity for top_k to track"),
                            ({"every_n_train_steps": 2, "every_n_epochs": 1}, "mutually exclusive")):
        with pytest.raises(ValueError, match=message):
            ModelCheckpoint(**kwargs)


def _early_stopping(options: dict[str, Any], validates: bool = True) -> Any:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        def logs(module: Any, place: str, loss: Any) -> None:
            if place == "train":
                module.log("train_loss", loss, on_epoch=True)
            elif place == "val":
                module.log("val_loss", loss)
            elif place == "train_epoch_end":
                module.log("epoch_score", float(module.current_epoch % 3))  # rises, falls: a metric of a hook

        stop = api.callbacks.EarlyStopping(**options)
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=8, callbacks=[stop], logger=False,
                                                  enable_checkpointing=False))
        module = probe_module(api.pl, logs=logs)
        trainer.fit(module, *(loaders() if validates else loaders()[:1]))
        return {"epochs": trainer.current_epoch, "stopped_epoch": stop.stopped_epoch, "wait": stop.wait_count,
                "best": float(stop.best_score), "metrics": floats(trainer.callback_metrics)}
    return run


STOPS = {
    "patience": ({"monitor": "val_loss", "patience": 2, "mode": "max"}, True),
    "patience_zero": ({"monitor": "val_loss", "patience": 0, "mode": "max"}, True),
    "min_delta": ({"monitor": "val_loss", "patience": 1, "min_delta": 0.5}, True),
    "stopping_threshold": ({"monitor": "val_loss", "stopping_threshold": 0.5}, True),
    "hook_metric_at_epoch_end": ({"monitor": "epoch_score", "patience": 1, "mode": "max"}, True),
    "training_metric_without_validation": ({"monitor": "train_loss_epoch", "patience": 1, "mode": "max"}, False),
    "after_validation": ({"monitor": "val_loss", "patience": 1, "mode": "max", "check_on_train_epoch_end": False},
                         True),
    "missing_not_strict": ({"monitor": "absent", "strict": False}, True),
}


@pytest.mark.parametrize("name", sorted(STOPS))
def test_early_stopping_decides_as_lightnings(name: str, tmp_path: pathlib.Path) -> None:
    options, validates = STOPS[name]
    records = both(_early_stopping(dict(options), validates), tmp_path)
    assert_same(records)


def test_early_stopping_on_a_missing_metric_is_an_error_when_strict(tmp_path: pathlib.Path) -> None:
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, callbacks=[EarlyStopping("absent")],
                                          logger=False, enable_checkpointing=False))
    with pytest.raises(RuntimeError, match="`absent` which is not available.*val_loss"):
        trainer.fit(probe_module(pl), *loaders())
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("val_loss", patience=-1)


def _rates(kind: str, options: dict[str, Any]) -> Any:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        def optimizers(module: Any) -> Any:
            first, second = list(module.net.parameters())
            if kind == "groups":
                opt = torch.optim.SGD([{"params": [first], "lr": 0.1}, {"params": [second], "lr": 0.01}],
                                      lr=0.1, momentum=0.9)
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
            if kind == "named_step":
                opt = torch.optim.Adam(module.parameters(), lr=0.05)
                scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "my"}}
            return torch.optim.Adam(module.parameters(), lr=0.01)

        monitor = api.callbacks.LearningRateMonitor(**options)
        csv_logger = api.loggers.CSVLogger(str(root))
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, callbacks=[monitor], logger=csv_logger,
                                                  log_every_n_steps=2, enable_checkpointing=False))
        trainer.fit(probe_module(api.pl, optimizers=optimizers), *loaders())
        with open(pathlib.Path(csv_logger.log_dir) / "metrics.csv", newline="") as file:
            rows = [{k: float(v) for k, v in row.items() if v and (k.startswith("lr") or k == "step")}
                    for row in csv.DictReader(file)]
        return {"lrs": monitor.lrs, "rows": [row for row in rows if len(row) > 1],
                "callback": sorted(k for k in trainer.callback_metrics if k.startswith("lr"))}
    return run


RATES = {
    "no_scheduler": ("plain", {}),
    "param_groups_with_momentum": ("groups", {"log_momentum": True, "log_weight_decay": True}),
    "named_step_scheduler": ("named_step", {}),
    "epoch_interval_at_every_step": ("groups", {"logging_interval": "step"}),
    "step_interval_at_epochs": ("named_step", {"logging_interval": "epoch"}),
}


@pytest.mark.parametrize("name", sorted(RATES))
def test_learning_rate_monitor_names_and_rows_match_lightnings(name: str, tmp_path: pathlib.Path) -> None:
    kind, options = RATES[name]
    records = both(_rates(kind, options), tmp_path)
    assert_same(records)


def test_learning_rate_monitor_needs_a_logger(tmp_path: pathlib.Path) -> None:
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, callbacks=[LearningRateMonitor()], logger=False,
                                          enable_checkpointing=False))
    with pytest.raises(ValueError, match="LearningRateMonitor.*no logger"):
        trainer.fit(probe_module(pl), loaders()[0])
    with pytest.raises(ValueError, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")


def test_model_summary_prints_the_table_at_fit_start(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    def fit(**kwargs: Any) -> str:
        trainer = pl.Trainer(**{**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False),
                                **kwargs})
        trainer.fit(probe_module(pl), loaders()[0])
        return capsys.readouterr().out

    out = fit(callbacks=[pl.callbacks.ModelSummary(max_depth=1)], enable_model_summary=True)
    assert "net  | Linear" in out and "4         Total params" in out
    assert "Total params" not in fit(callbacks=[pl.callbacks.ModelSummary(max_depth=0)], enable_model_summary=True)
    assert "Total params" in fit(enable_model_summary=True)  # the default ModelSummary
    with pytest.raises(ValueError, match="max_depth"):
        pl.callbacks.ModelSummary(max_depth=-2)


def test_a_progress_bar_of_refresh_rate_0_draws_nothing(tmp_path: pathlib.Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=1, callbacks=[TQDMProgressBar(refresh_rate=0)],
                         enable_model_summary=False, logger=False, enable_checkpointing=False)
    trainer.fit(probe_module(pl), loaders()[0])
    captured = capsys.readouterr()
    assert "Epoch 0" not in captured.err and trainer.progress_bar_callback.is_disabled
    with pytest.raises(ValueError, match="process_position"):
        TQDMProgressBar(process_position=1)
    with pytest.raises(ValueError, match="enable_progress_bar=False"):
        pl.Trainer(enable_progress_bar=False, callbacks=[TQDMProgressBar()])


@pytest.mark.parametrize("leave", [False, True], ids=["leave=False (the default)", "leave=True"])
def test_tqdm_progress_bar_leaves_the_lines_lightnings_leaves(tmp_path: pathlib.Path, leave: bool) -> None:
    """leave=False: one bar, reset at each epoch (the last epoch's line stays); leave=True: a line per epoch."""

    def run(api: Any, root: pathlib.Path) -> list[str]:
        shown = io.StringIO()  # Lightning draws on stdout, fittrain on stderr: both are read
        with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
            trainer = api.pl.Trainer(**trainer_kwargs(root, enable_progress_bar=True, max_epochs=3, logger=False,
                                                      enable_checkpointing=False),
                                     callbacks=[api.callbacks.TQDMProgressBar(leave=leave)])
            trainer.fit(probe_module(api.pl), loaders()[0])
        last_draws = (line.rsplit("\r", 1)[-1] for line in shown.getvalue().split("\n"))
        return [draw.split(":")[0] for draw in last_draws if draw.startswith("Epoch ")]

    records = both(run, tmp_path)
    assert records["lightning"] == (["Epoch 0", "Epoch 1", "Epoch 2"] if leave else ["Epoch 2"])
    assert_same(records)
