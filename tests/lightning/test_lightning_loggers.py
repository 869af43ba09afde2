"""fittrain.lightning.loggers next to Lightning's: the files TensorBoardLogger and CSVLogger write (their
folders, versions, rows and hparams.yaml), what `experiment` is, and MLFlowLogger's and WandbLogger's
runs (offline: mlflow in a file store, wandb in offline mode in a fresh interpreter)."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import fittrain.lightning as pl
from fittrain.lightning.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning_programs import assert_same, both, loaders, relative_files, trainer_kwargs


def _module_with_hparams(api: Any) -> Any:
    class Tuned(api.pl.LightningModule):
        def __init__(self, lr: float = 0.1, width: int = 3, note: str = "x") -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(self.hparams.width, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def on_train_epoch_end(self) -> None:
            self.log("epoch_hook", float(self.current_epoch) + 0.5)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return Tuned(lr=0.05)


def _csv_rows(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _files(api: Any, root: pathlib.Path) -> dict[str, Any]:
    csv_logger = api.loggers.CSVLogger(str(root), name="csv", prefix="run")
    tensorboard = api.loggers.TensorBoardLogger(str(root))
    for _ in range(2):  # a second fit of a new Trainer writes the next version
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, log_every_n_steps=2,
                                                  logger=[tensorboard, csv_logger]))
        trainer.fit(_module_with_hparams(api), *loaders())
        tensorboard = api.loggers.TensorBoardLogger(str(root))
        csv_logger = api.loggers.CSVLogger(str(root), name="csv", prefix="run")
    rows = _csv_rows(root / "csv" / "version_1" / "metrics.csv")
    return {
        "files": [name for name in relative_files(root) if not name.endswith("saves.json")],
        "header": list(rows[0]),
        "rows": [{k: float(v) for k, v in row.items() if v} for row in rows],
        "csv_hparams": (root / "csv" / "version_1" / "hparams.yaml").read_text(),
        "tb_hparams": (root / "lightning_logs" / "version_1" / "hparams.yaml").read_text(),
        "scalars": _scalars(root / "lightning_logs" / "version_1"),
        "log_dir": os.path.relpath(trainer.log_dir, root), "version": trainer.logger.version,
    }


def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in sorted(events.Tags()["scalars"])}


def test_tensorboard_and_csv_files_match_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(_files, tmp_path)
    assert_same(records)
    record = records["fittrain"]
    assert "lightning_logs/version_1/hparams.yaml" in record["files"] and record["version"] == 1
    assert record["header"][:2] == ["run-epoch", "run-epoch_hook"] and "lr: 0.05" in record["tb_hparams"]


def _experiment(api: Any, root: pathlib.Path) -> dict[str, Any]:
    class Images(api.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def on_train_epoch_end(self) -> None:
            self.logger.experiment.add_image("weights", self.net.weight.detach().reshape(1, 1, 3), self.current_epoch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logger = api.loggers.TensorBoardLogger(str(root), name="named", version="custom", sub_dir="tb")
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=logger, enable_checkpointing=False))
    trainer.fit(Images(), loaders()[0])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    return {"log_dir": os.path.relpath(logger.log_dir, root), "root_dir": os.path.relpath(logger.root_dir, root),
            "images": [e.step for e in events.Images("weights")], "type": type(logger.experiment).__name__,
            "trainer_log_dir": os.path.relpath(trainer.log_dir, root)}


def test_the_experiment_is_a_summary_writer_in_lightnings_folder(tmp_path: pathlib.Path) -> None:
    records = both(_experiment, tmp_path)
    assert_same(records)
    assert records["fittrain"]["log_dir"] == "named/custom/tb"


def test_logger_arguments_fittrain_does_not_support_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="log_graph=True.*add_graph"):
        TensorBoardLogger(str(tmp_path), log_graph=True)
    with pytest.raises(TypeError, match="save_dir"):
        CSVLogger(None)
    with pytest.raises(ValueError, match="log_model"):
        WandbLogger(log_model=True)
    with pytest.raises(ValueError, match="artifact_location"):
        MLFlowLogger(artifact_location="s3://bucket")


def _mlflow(api: Any, root: pathlib.Path) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    uri = f"file:{root / 'mlruns'}"
    logger = api.loggers.MLFlowLogger(experiment_name="exp", run_name="first", tracking_uri=uri)
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, log_every_n_steps=2, logger=logger))
    trainer.fit(_module_with_hparams(api), *loaders())
    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(logger.run_id, key)]
               for key in sorted(run.data.metrics)}
    return {"params": dict(run.data.params), "history": history, "status": run.info.status,
            "name": run.info.run_name, "experiment": type(logger.experiment).__name__,
            "checkpoints": [name for name in relative_files(root) if "checkpoints/" in name and
                            not name.endswith("saves.json")]}


def test_mlflow_logger_writes_lightnings_run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store in tmp_path: no server, no network
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # put back after the test
    try:
        records = both(_mlflow, tmp_path)
    finally:
        # Lightning's MLFlowLogger sets mlflow's process-wide tracking URI (and $MLFLOW_TRACKING_URI): later
        # tests in this process would log into this test's folder (fittrain's logger sets neither).
        mlflow.set_tracking_uri(None)
    for record in records.values():  # mlruns/{experiment id}/{run id}/checkpoints/...: the ids differ by run
        record["checkpoints"] = [name.split("/", 3)[-1] for name in record["checkpoints"]]
    assert_same(records)
    assert records["fittrain"]["params"] == {"lr": "0.05", "width": "3", "note": "x"}


WANDB_PROGRAM = textwrap.dedent("""
    import json, sys, torch
    from torch.utils.data import DataLoader, TensorDataset
    import fittrain.lightning as pl
    from fittrain.lightning.loggers import WandbLogger

    class M(pl.LightningModule):
        def __init__(self, lr=0.05):
            super().__init__(); self.save_hyperparameters(); self.net = torch.nn.Linear(3, 1)
        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]); self.log("loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    x = torch.randn(16, 3)
    logger = WandbLogger(project="proj", name="first", save_dir=sys.argv[1], offline=True)
    trainer = pl.Trainer(max_epochs=2, log_every_n_steps=1, logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False)
    trainer.fit(M(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    run = logger.experiment
    print(json.dumps({"config": dict(run.config), "summary": {k: run.summary[k] for k in run.summary.keys()
                      if not k.startswith("_")}, "name": logger.name, "version": logger.version == run.id,
                      "run_name": run.name}))
    run.finish()
""")


@pytest.mark.subprocess
def test_wandb_logger_runs_offline(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "c"),
               WANDB_CACHE_DIR=str(tmp_path / "cache"), WANDB_DATA_DIR=str(tmp_path / "data"),
               WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true", WANDB_CONSOLE="off", WANDB_X_DISABLE_STATS="true")
    done = subprocess.run([sys.executable, "-c", WANDB_PROGRAM, str(tmp_path / "runs")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["config"] == {"lr": 0.05} and record["name"] == "proj" and record["version"]
    assert record["run_name"] == "first" and record["summary"]["trainer/global_step"] == 7
    assert set(record["summary"]) >= {"loss", "epoch", "trainer/global_step"}


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_a_logger_writes_on_the_main_process_only(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                  launcher: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    if launcher == "torchrun":
        monkeypatch.setenv("RANK", "1")  # what torchrun gives the second process
    else:  # what srun gives the second task of a 2-task step, without torchrun
        monkeypatch.setenv("SLURM_PROCID", "1")
        monkeypatch.setenv("SLURM_NTASKS", "2")
        monkeypatch.setenv("SLURM_NODELIST", "node1")
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    logger = CSVLogger(str(tmp_path))
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"lr": 0.1})
    logger.save()
    board = TensorBoardLogger(str(tmp_path), name="tb")
    board.log_metrics({"x": 1.0}, step=0)
    board.experiment.add_scalar("y", 2.0, 0)  # absorbed
    assert not (tmp_path / "lightning_logs").exists() and not (tmp_path / "tb").exists()
    if launcher == "torchrun":  # (under srun's variables a Trainer would join the 2-task job's process group)
        assert pl.Trainer(logger=logger, default_root_dir=str(tmp_path)).logger is logger
