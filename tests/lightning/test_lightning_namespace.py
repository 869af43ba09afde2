"""fittrain.lightning as a namespace: its names, what they are in fittrain, and a small program's observable
results next to Lightning's (hook counts, metric views, stages, schedulers, self.logger, load_from_checkpoint).

Each comparison runs one program with `lightning.pytorch` and with `fittrain.lightning` in this process
(tests/lightning/lightning_programs.py) and asserts the records are the same.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import fittrain
import fittrain.lightning as pl
from fittrain.lightning import callbacks, loggers
from fittrain.lightning.missing import Missing
from fittrain.trainer.progress import ProgressBar
from lightning_programs import (
    assert_same,
    both,
    dataset,
    floats,
    loaders,
    probe_callback,
    probe_module,
    trainer_kwargs,
)


def test_the_namespace_maps_onto_fittrain_classes() -> None:
    from fittrain.lightning.core import LightningDataModule, LightningModule
    from fittrain.lightning.trainer import Trainer

    assert LightningModule is pl.LightningModule and LightningDataModule is pl.LightningDataModule
    assert Trainer is pl.Trainer and issubclass(pl.Trainer, fittrain.Trainer)
    assert issubclass(pl.LightningModule, fittrain.TrainModule)
    assert issubclass(pl.LightningDataModule, fittrain.DataModule)
    assert pl.seed_everything is fittrain.seed_everything
    assert pl.Callback is callbacks.Callback
    assert set(callbacks.__all__) >= {"Callback", "ModelCheckpoint", "EarlyStopping", "LearningRateMonitor",
                                      "ModelSummary", "TQDMProgressBar"}
    assert set(loggers.__all__) >= {"Logger", "TensorBoardLogger", "CSVLogger", "WandbLogger", "MLFlowLogger"}
    assert issubclass(callbacks.ModelCheckpoint, pl.Callback) and issubclass(callbacks.EarlyStopping, pl.Callback)
    assert issubclass(callbacks.ModelCheckpoint, callbacks.Checkpoint)  # `isinstance(cb, Checkpoint)` finds it
    assert issubclass(callbacks.TQDMProgressBar, callbacks.ProgressBar)
    assert issubclass(pl.strategies.DDPStrategy, pl.strategies.ParallelStrategy)


@pytest.mark.parametrize("module", ["", ".callbacks", ".loggers", ".strategies"])
def test_every_public_lightning_name_imports_and_a_missing_one_refuses_to_be_built(module: str) -> None:
    import importlib

    theirs = importlib.import_module(f"lightning.pytorch{module}")
    ours = importlib.import_module(f"fittrain.lightning{module}")
    absent = [name for name in theirs.__all__ if not hasattr(ours, name)]
    assert not absent, f"fittrain.lightning{module} lacks Lightning's {absent}: add them to lightning/missing.py"
    for name in theirs.__all__:
        made = getattr(ours, name)
        if isinstance(made, type) and issubclass(made, Missing):
            with pytest.raises(NotImplementedError, match=rf"^{name}: fittrain.lightning does not provide .*Instead: "):
                made(1, key="value")  # whatever the arguments: refused where built


#: Lightning's module paths that programs import names from, beyond the packages' own (`from
#: lightning.pytorch.loggers.tensorboard import TensorBoardLogger`), with the names they import there.
SUBMODULE_NAMES = {
    "core.module": ["LightningModule"],
    "core.datamodule": ["LightningDataModule"],
    "trainer.trainer": ["Trainer"],
    "trainer.states": ["TrainerFn", "RunningStage", "TrainerStatus"],
    "callbacks.callback": ["Callback"],
    "callbacks.checkpoint": ["Checkpoint"],
    "loggers.logger": ["Logger", "DummyLogger", "rank_zero_experiment"],
    "loggers.tensorboard": ["TensorBoardLogger"],
    "loggers.csv_logs": ["CSVLogger", "ExperimentWriter"],
    "loggers.wandb": ["WandbLogger"],
    "loggers.mlflow": ["MLFlowLogger"],
    "utilities.exceptions": ["MisconfigurationException"],
}


@pytest.mark.parametrize("path", sorted(SUBMODULE_NAMES))
def test_lightnings_module_paths_import_the_same_names(path: str) -> None:
    import importlib

    theirs = importlib.import_module(f"lightning.pytorch.{path}")
    ours = importlib.import_module(f"fittrain.lightning.{path}")
    package = importlib.import_module(f"fittrain.lightning.{path.split('.')[0]}")
    for name in SUBMODULE_NAMES[path]:
        assert hasattr(theirs, name), f"lightning.pytorch.{path} has no {name}: the table above is wrong"
        made = getattr(ours, name)
        # The same object as under the package's name (or the top-level one), not a second definition.
        assert made is getattr(package, name, getattr(pl, name, made)), (path, name)
    assert set(getattr(ours, "__all__", ())) >= set(SUBMODULE_NAMES[path]) or path.startswith("trainer.")


def test_rank_zero_experiment_gives_the_experiment_on_rank_zero_and_an_absorber_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fittrain.lightning.loggers.logger import Logger, rank_zero_experiment
    from fittrain.lightning.utilities.exceptions import MisconfigurationException

    class ListLogger(Logger):
        @property
        @rank_zero_experiment
        def experiment(self) -> list[Any]:
            return self.rows

        rows: list[Any] = []

    logger = ListLogger()
    assert logger.experiment is ListLogger.rows
    monkeypatch.setenv("RANK", "1")  # what torchrun tells the second process; no process group here
    other = logger.experiment
    assert other is not ListLogger.rows
    assert other.append("row") is None and ListLogger.rows == []  # any call is taken and does nothing
    assert issubclass(MisconfigurationException, Exception)


@pytest.mark.subprocess
def test_fittrain_lightning_never_imports_lightning(tmp_path: pathlib.Path) -> None:
    code = textwrap.dedent("""
        import sys, torch
        from torch.utils.data import DataLoader, TensorDataset
        import fittrain.lightning as pl
        from fittrain.lightning.callbacks import ModelCheckpoint, EarlyStopping, LearningRateMonitor
        from fittrain.lightning.loggers import CSVLogger, TensorBoardLogger

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__(); self.net = torch.nn.Linear(3, 1)
            def training_step(self, batch, batch_idx):
                loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]); self.log("loss", loss)
                return loss
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        x = torch.randn(16, 3)
        pl.Trainer(max_epochs=1, enable_progress_bar=False, logger=CSVLogger(".")).fit(
            M(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
        used = sorted(name for name in sys.modules if name.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not used, used
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


def _fit_and_test(api: Any, root: pathlib.Path) -> dict[str, Any]:
    module, callback = probe_module(api.pl), probe_callback(api.pl)
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, callbacks=[callback], log_every_n_steps=2))
    train, val = loaders()
    trainer.fit(module, train, val)
    record = {
        "callback_metrics": floats(trainer.callback_metrics), "logged_metrics": floats(trainer.logged_metrics),
        "progress_bar_metrics": floats(trainer.progress_bar_metrics), "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch, "module_calls": dict(module.calls), "seen": dict(module.seen),
        "callback_calls": dict(callback.calls), "notes": dict(callback.notes),
    }
    record["test"] = trainer.test(module, DataLoader(dataset(), batch_size=8), verbose=False)
    record["after_test"] = floats(trainer.callback_metrics)
    record["after_test_calls"] = dict(callback.calls)
    return record


def test_metric_views_and_hook_counts_match_lightning(tmp_path: pathlib.Path) -> None:
    records = both(_fit_and_test, tmp_path)
    assert_same(records)
    fitted = records["fittrain"]
    # What Lightning's views hold, by name (the comparison above says the values are Lightning's too).
    assert set(fitted["callback_metrics"]) == {"loss", "loss_step", "loss_epoch", "double", "val_loss"}
    assert set(fitted["logged_metrics"]) == {"loss_step", "loss_epoch", "double", "val_loss"}
    assert set(fitted["progress_bar_metrics"]) == {"loss_step", "loss_epoch"}
    assert fitted["notes"]["sanity_checking"] == [True, False, False]  # the sanity check, then two epochs
    assert fitted["notes"]["outputs"][0] == ["loss"]  # a returned loss reaches callbacks as {"loss": loss}
    assert set(fitted["after_test"]) == {"test_loss"}  # a new stage starts the views over


def _scheduled(interval_form: str) -> Any:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        def optimizers(module: Any) -> Any:
            opt = torch.optim.SGD(module.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"lists": ([opt], [sched]),
                    "dict": {"optimizer": opt, "lr_scheduler": sched},
                    "dict_no_interval": {"optimizer": opt, "lr_scheduler": {"scheduler": sched}},
                    "step": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}}[interval_form]

        module = probe_module(api.pl, optimizers=optimizers)
        rates: list[float] = []

        class Rates(api.pl.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                rates.append(trainer.optimizers[0].param_groups[0]["lr"])

        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=3, callbacks=[Rates()], logger=False,
                                                  enable_checkpointing=False))
        trainer.fit(module, loaders()[0])
        return {"rates": rates, "weights": float(module.net.weight.sum())}
    return run


@pytest.mark.parametrize("form", ["lists", "dict", "dict_no_interval", "step"])
def test_schedulers_step_when_lightnings_do(form: str, tmp_path: pathlib.Path) -> None:
    records = both(_scheduled(form), tmp_path)
    assert_same(records)
    rates = records["fittrain"]["rates"]
    assert len(set(rates)) == (len(rates) if form == "step" else 3)  # per step, or per epoch (Lightning's default)


def _stages(api: Any, root: pathlib.Path) -> dict[str, Any]:
    class OwnData(api.pl.LightningModule):
        """Builds its data in setup and serves it from its own *_dataloader methods."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)
            self.stages: list[str] = []

        def setup(self, stage: str) -> None:
            self.stages.append(f"setup:{getattr(stage, 'value', stage)}")  # Lightning's TrainerFn is a str enum
            self.data = dataset(24)

        def teardown(self, stage: str) -> None:
            self.stages.append(f"teardown:{getattr(stage, 'value', stage)}")

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=8, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=8)

        def test_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=12)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = OwnData()
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=False, enable_checkpointing=False))
    trainer.fit(module)
    fit = floats(trainer.callback_metrics)
    test = trainer.test(module, verbose=False)
    return {"stages": module.stages, "fit": fit, "test": test, "global_step": trainer.global_step,
            "logger": trainer.logger, "loggers": trainer.loggers}


def test_setup_teardown_stages_and_the_modules_own_loaders_match_lightning(tmp_path: pathlib.Path) -> None:
    records = both(_stages, tmp_path)
    assert_same(records)
    assert records["fittrain"]["stages"] == ["setup:fit", "teardown:fit", "setup:test", "teardown:test"]


def _loggers_seen(api: Any, root: pathlib.Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Looks(api.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 0:
                seen["logger_is_trainers"] = self.logger is self.trainer.logger
                seen["loggers"] = [type(logger).__name__ for logger in self.loggers]
                seen["experiments"] = [type(logger.experiment).__name__ for logger in self.loggers]
                self.loggers[0].experiment.add_scalar("custom", 1.5, self.global_step)
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    csv = api.loggers.CSVLogger(str(root), name="csv")
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, logger=[api.loggers.TensorBoardLogger(str(root)),
                                                                          csv]))
    trainer.fit(Looks(), loaders()[0])
    seen["log_dir"] = pathlib.Path(trainer.log_dir).relative_to(root).as_posix()
    seen["csv_log_dir"] = pathlib.Path(csv.log_dir).relative_to(root).as_posix()
    return seen


def test_self_logger_and_the_loggers_experiments_are_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(_loggers_seen, tmp_path)
    assert_same(records)
    assert records["fittrain"]["experiments"][0] == "SummaryWriter"


def _custom_logger(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """A logger of the program's own, written as Lightning's docs show (imports from the module paths)."""
    import importlib

    rank_zero_experiment = importlib.import_module(f"{api.pl.__name__}.loggers.logger").rank_zero_experiment
    rank_zero_only = importlib.import_module(f"{api.pl.__name__}.utilities.rank_zero").rank_zero_only

    class ListLogger(api.loggers.Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[Any] = []

        @property
        def name(self) -> str:
            return "listed"

        @property
        def version(self) -> str:
            return "v0"

        @property
        @rank_zero_experiment
        def experiment(self) -> list[Any]:
            return self.rows

        @rank_zero_only
        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            self.experiment.append(("hparams", sorted(dict(params))))

        @rank_zero_only
        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.experiment.append((step, sorted(metrics)))

    logger = ListLogger()
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=logger, log_every_n_steps=2))
    trainer.fit(probe_module(api.pl), *loaders())
    return {"rows": logger.rows, "log_dir": trainer.log_dir, "logger_is_it": trainer.logger is logger,
            "checkpoints": os.path.relpath(trainer.checkpoint_callback.dirpath, root),
            # fittrain's record of the order of saves (docs/coming_from_lightning.md) is no checkpoint.
            "saved": sorted(set(os.listdir(trainer.checkpoint_callback.dirpath)) - {"saves.json"})}


def test_a_logger_of_the_programs_own_gets_lightnings_rows_and_folders(tmp_path: pathlib.Path) -> None:
    records = both(_custom_logger, tmp_path)
    assert_same(records)
    record = records["fittrain"]
    assert record["log_dir"] is None and record["checkpoints"] == os.path.join("listed", "v0", "checkpoints")
    assert len(record["rows"]) > 3 and record["saved"] == ["epoch=1-step=10.ckpt"]


def _evaluation_on_step(api: Any, root: pathlib.Path) -> dict[str, Any]:
    def logs(module: Any, place: str, loss: Any) -> None:
        if place == "train":
            module.log("train_loss", loss)
        elif place in ("val", "test"):
            module.log(f"{place}_loss", loss, on_step=True)  # Lightning's autoencoder example does this
            module.log(f"{place}_mae", loss.sqrt(), prog_bar=True)

    module = probe_module(api.pl, logs=logs)
    csv = api.loggers.CSVLogger(str(root))
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=csv, num_sanity_val_steps=0))
    trainer.fit(module, *loaders())
    record = {"fit": floats(trainer.callback_metrics), "logged": floats(trainer.logged_metrics),
              "bar": floats(trainer.progress_bar_metrics)}
    record["test"] = trainer.test(module, loaders()[1], verbose=False)
    record["after_test"] = floats(trainer.callback_metrics)
    record["csv"] = (pathlib.Path(csv.log_dir) / "metrics.csv").read_text().splitlines()[0]
    return record


def test_on_step_in_evaluation_gives_lightnings_names(tmp_path: pathlib.Path) -> None:
    records = both(_evaluation_on_step, tmp_path)
    assert_same(records)
    assert {"val_loss", "val_loss_epoch"} <= set(records["fittrain"]["fit"])
    assert list(records["fittrain"]["test"][0]) == ["test_loss_epoch", "test_mae"]


def _values_of_every_kind(api: Any, root: pathlib.Path) -> dict[str, Any]:
    import numpy as np

    def logs(module: Any, place: str, loss: Any) -> None:
        if place == "train":
            module.log("weight", module.net.weight[0, 0], on_step=True, on_epoch=True)  # the optimizer steps it
            module.log("bias", module.net.bias, on_epoch=True)  # a parameter itself
            module.log_dict({"np32": np.float32(0.5), "np_int": np.int64(3), "flag": True})
        elif place == "val":
            module.log("val_np", np.float32(loss.item()))

    module = probe_module(api.pl, logs=logs)
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=False, enable_checkpointing=False,
                                              num_sanity_val_steps=0))
    trainer.fit(module, *loaders())
    return {"fit": floats(trainer.callback_metrics), "logged": floats(trainer.logged_metrics)}


def test_logged_values_that_change_later_and_numbers_of_every_kind_match_lightning(tmp_path: pathlib.Path) -> None:
    """A logged parameter (or a view of one) keeps its value at the call, step and epoch values alike, and
    NumPy scalars and bools are numbers, as in Lightning."""
    records = both(_values_of_every_kind, tmp_path)
    assert_same(records)
    assert {"weight_step", "weight_epoch", "bias_step", "bias_epoch", "np32", "flag", "val_np"} <= set(
        records["fittrain"]["fit"])


def test_a_lightning_hook_fittrain_never_calls_is_refused(tmp_path: pathlib.Path) -> None:
    class Steps(pl.LightningModule):
        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            pass

    trainer = pl.Trainer(**trainer_kwargs(tmp_path, logger=False, enable_checkpointing=False))
    with pytest.raises(NotImplementedError, match="optimizer_step.*would silently never run"):
        trainer.fit(Steps(), loaders()[0])

    class ZeroGrad(pl.Callback):
        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            pass

    with pytest.raises(NotImplementedError, match="on_before_zero_grad.*on_before_optimizer_step"):
        pl.Trainer(callbacks=[ZeroGrad()], default_root_dir=str(tmp_path))
    with pytest.raises(TypeError, match="`model` must be a `LightningModule`"):
        trainer.fit(fittrain.TrainModule(), loaders()[0])


def test_load_from_checkpoint_rebuilds_the_module_from_a_checkpoint_folder(tmp_path: pathlib.Path) -> None:
    class Sized(pl.LightningModule):
        def __init__(self, hidden: int = 4, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Linear(hidden, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    module = Sized(hidden=5, lr=0.05)
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=False))
    trainer.fit(module, loaders()[0])
    path = trainer.checkpoint_callback.best_model_path
    assert path.endswith("epoch=1-step=10.ckpt") and pathlib.Path(path).is_dir()
    loaded = Sized.load_from_checkpoint(path)
    assert dict(loaded.hparams) == {"hidden": 5, "lr": 0.05}
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert Sized.load_from_checkpoint(path, lr=0.5).hparams.lr == 0.5  # keyword arguments win
    with pytest.raises(ValueError, match="hparams_file"):
        Sized.load_from_checkpoint(path, hparams_file="hparams.yaml")


def test_save_checkpoint_writes_a_folder_fit_resumes_and_load_from_checkpoint_reads(tmp_path: pathlib.Path) -> None:
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False))
    with pytest.raises(RuntimeError, match="Call fit first"):
        trainer.save_checkpoint(tmp_path / "early.ckpt")
    module = probe_module(pl)
    trainer.fit(module, *loaders())
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    assert (tmp_path / "final.ckpt" / "model.safetensors").is_file()
    resumed = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=False, enable_checkpointing=False))
    resumed.fit(probe_module(pl), *loaders(), ckpt_path=tmp_path / "final.ckpt")
    assert (resumed.current_epoch, resumed.global_step) == (2, 10)  # the second epoch only
    loaded = type(module).load_from_checkpoint(tmp_path / "final.ckpt")
    assert torch.equal(loaded.net.weight, module.net.weight)
    with pytest.raises(ValueError, match="weights_only=True"):
        trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)


def _loaders_and_limits(api: Any, root: pathlib.Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Module(api.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            trainer = self.trainer
            seen["train"] = [len(trainer.train_dataloader), trainer.train_dataloader.batch_size,
                             len(trainer.train_dataloader.dataset)]
            seen["val"] = [len(trainer.val_dataloaders), trainer.val_dataloaders.batch_size]
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    limits = {"limit_train_batches": 3, "limit_val_batches": 0.5}
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, logger=False, enable_checkpointing=False, **limits))
    trainer.fit(Module(), *loaders())
    seen["limits"] = [trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches,
                      trainer.limit_predict_batches]
    return seen


def test_the_loaders_and_limits_a_program_reads_are_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(_loaders_and_limits, tmp_path)
    assert_same(records)
    assert records["fittrain"]["limits"] == [3, 0.5, 1.0, 1.0] and records["fittrain"]["train"] == [5, 8, 40]


def test_a_lightning_trainer_attribute_fittrain_lacks_names_the_fittrain_way(tmp_path: pathlib.Path) -> None:
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(AttributeError, match=r"fittrain\.lightning's Trainer has no 'strategy' \(Lightning's "
                                             r"Trainer\.strategy\): fittrain has no strategy object; "
                                             r"trainer\.accelerator does its work \(wait_for_everyone\(\)"):
        trainer.strategy.barrier()
    with pytest.raises(AttributeError, match=r"no 'fit_loop' .* trainer\.state \(epoch, global_step, batch_idx\)"):
        _ = trainer.fit_loop
    with pytest.raises(AttributeError, match=r"^'Trainer' object has no attribute 'no_such_thing'$"):
        _ = trainer.no_such_thing
    assert not hasattr(trainer, "tuner") and getattr(trainer, "ckpt_path", "absent") == "absent"


def _module_surface(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """What a program reads off a module before and after save_hyperparameters, and the batch counts per
    loader; the module scripted and traced, as Lightning's `to_torchscript` does."""

    class Plain(api.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3, 1)
            self.example_input_array = torch.zeros(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Saved(Plain):
        def __init__(self, width: int = 3, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.hparams.lr = 0.2  # after saving: hparams change, hparams_initial keeps the first values

    plain = Plain()
    seen: dict[str, Any] = {"unsaved": dict(plain.hparams), "unsaved_initial": dict(plain.hparams_initial)}
    plain.hparams.note = "kept"  # a program may fill the empty dict
    seen["filled"] = dict(plain.hparams)
    saved = Saved(width=4)
    seen["saved"], seen["saved_initial"] = dict(saved.hparams), dict(saved.hparams_initial)
    seen["flags"] = [plain.on_gpu, plain.strict_loading, plain.training]
    x = torch.randn(5, 3)
    for method in ("script", "trace"):
        compiled = plain.to_torchscript(method=method, file_path=root / f"{method}.pt")
        seen[method] = [type(compiled).__name__, torch.equal(compiled(x), plain(x)),
                        torch.equal(torch.jit.load(str(root / f"{method}.pt"))(x), plain(x)), plain.training]
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, logger=False, enable_checkpointing=False,
                                              num_sanity_val_steps=2))
    trainer.fit(plain, *loaders())
    seen["fit"] = [trainer.num_training_batches, trainer.num_val_batches, trainer.num_sanity_val_batches]
    trainer.predict(plain, loaders()[1])
    seen["predict"] = trainer.num_predict_batches
    return seen


def test_hparams_before_saving_torchscript_and_batch_counts_per_loader_are_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(_module_surface, tmp_path)
    assert_same(records)
    mine = records["fittrain"]
    assert mine["unsaved"] == {} and mine["filled"] == {"note": "kept"}
    assert mine["saved"] == {"width": 4, "lr": 0.2} and mine["saved_initial"] == {"width": 4, "lr": 0.1}
    assert mine["script"] == ["RecursiveScriptModule", True, True, True] and mine["fit"] == [5, [5], [2]]


def test_unsaved_hparams_are_recorded_nowhere_and_strict_loading_is_honoured(tmp_path: pathlib.Path) -> None:
    module = probe_module(pl)
    module.hparams.scratch = 1  # as in Lightning: without save_hyperparameters, neither checkpoints nor trackers
    assert module.recordable_hparams() is None
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False))
    trainer.fit(module, *loaders())
    trainer.save_checkpoint(tmp_path / "final.ckpt")

    class Extended(type(module)):  # a layer the checkpoint lacks
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

    with pytest.raises(RuntimeError, match="Missing key"):
        Extended.load_from_checkpoint(tmp_path / "final.ckpt")
    Extended.strict_loading = False  # Lightning's switch: load_from_checkpoint(strict=None) follows it
    assert torch.equal(Extended.load_from_checkpoint(tmp_path / "final.ckpt").net.weight, module.net.weight)
    with pytest.raises(ValueError, match=r"Trainer\.fit\(ckpt_path=.*strict_loading=False: fittrain restores a "
                                         r"checkpoint whole.*load_from_checkpoint\(path, strict=False\)"):
        pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=2, logger=False)).fit(
            Extended(), *loaders(), ckpt_path=tmp_path / "final.ckpt")


def _module_callbacks(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """A module returning an EarlyStopping (replacing the Trainer's) and a LearningRateMonitor from
    `configure_callbacks`: the Trainer's callbacks, the EarlyStopping in force, the lr it logged."""
    base = probe_module(api.pl)

    class WithCallbacks(type(base)):
        def configure_callbacks(self) -> Any:
            return [api.callbacks.EarlyStopping("val_loss", patience=7), api.callbacks.LearningRateMonitor()]

    given = api.callbacks.EarlyStopping("val_loss", patience=1)
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, callbacks=[given]))
    module = WithCallbacks()
    seen: dict[str, Any] = {"before": [type(cb).__name__ for cb in trainer.callbacks]}
    trainer.fit(module, *loaders())
    seen["after"] = [type(cb).__name__ for cb in trainer.callbacks]
    seen["early_stopping"] = [trainer.early_stopping_callback.patience, given in trainer.callbacks]
    seen["lr"] = floats({k: v for k, v in trainer.callback_metrics.items() if k.startswith("lr")})
    trainer.validate(module, loaders()[1], verbose=False)  # called again at each stage: still one of each
    seen["validate"] = [type(cb).__name__ for cb in trainer.callbacks]
    return seen


def test_configure_callbacks_replaces_the_trainers_of_the_same_class_as_lightning(tmp_path: pathlib.Path) -> None:
    records = both(_module_callbacks, tmp_path)
    assert_same(records)
    mine = records["fittrain"]
    assert mine["after"] == ["EarlyStopping", "LearningRateMonitor", "ModelCheckpoint"] == mine["validate"]
    assert mine["before"] == ["EarlyStopping", "ModelCheckpoint"] and mine["early_stopping"] == [7, False]
    assert mine["lr"] == {"lr-SGD": pytest.approx(0.1)}


def test_configure_callbacks_refuses_what_is_no_callback_and_a_second_checkpoint(tmp_path: pathlib.Path) -> None:
    base = type(probe_module(pl))
    returned: list[Any] = []

    class Returns(base):
        def configure_callbacks(self) -> Any:
            return returned

    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False))
    returned[:] = [object()]
    with pytest.raises(TypeError, match=r"Returns\.configure_callbacks\(\) must return fittrain\.lightning callbacks"):
        trainer.fit(Returns(), *loaders())

    class Named(callbacks.ModelCheckpoint):
        pass

    returned[:] = [Named(), callbacks.ModelCheckpoint(every_n_epochs=2)]
    with pytest.raises(ValueError, match="adds a ModelCheckpoint beside 1 other"):
        trainer.fit(Returns(), *loaders())


def _state_readings(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """trainer.state.fn / .stage / .status and the Trainer's stage flags, read in each loop's hooks and
    between stages."""
    seen: dict[str, Any] = {}

    def reading(trainer: Any) -> list[Any]:
        state = trainer.state
        return [getattr(state.fn, "value", state.fn), getattr(state.stage, "value", state.stage),
                getattr(state.status, "value", state.status), trainer.training, trainer.validating,
                trainer.testing, trainer.predicting, trainer.evaluating, trainer.sanity_checking]

    class Reader(api.pl.Callback):
        def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
            seen["sanity_check_start"] = reading(trainer)

        def on_validation_batch_start(self, trainer: Any, *args: Any) -> None:
            seen.setdefault("sanity" if trainer.sanity_checking else f"validation_{trainer.state.fn.value}",
                            reading(trainer))

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            seen.setdefault("train", reading(trainer))

        def on_test_batch_start(self, trainer: Any, *args: Any) -> None:
            seen.setdefault("test", reading(trainer))

        def on_predict_batch_start(self, trainer: Any, *args: Any) -> None:
            seen.setdefault("predict", reading(trainer))

    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, logger=False, enable_checkpointing=False,
                                              callbacks=[Reader()]))
    seen["before"] = reading(trainer)
    module = probe_module(api.pl)
    trainer.fit(module, *loaders())
    seen["after_fit"] = reading(trainer)
    trainer.validate(module, loaders()[1], verbose=False)
    trainer.test(module, loaders()[1], verbose=False)
    trainer.predict(module, loaders()[1])
    seen["after_predict"] = reading(trainer)
    return seen


def test_trainer_state_fn_stage_and_status_are_lightnings(tmp_path: pathlib.Path) -> None:
    from fittrain.lightning.trainer.states import RunningStage, TrainerFn

    records = both(_state_readings, tmp_path)
    assert_same(records)
    mine = records["fittrain"]
    assert mine["train"][:3] == ["fit", "train", "running"] and mine["sanity"][:3] == ["fit", "sanity_check", "running"]
    assert mine["after_fit"][:4] == ["fit", None, "finished", False] and mine["before"][2] == "initializing"
    assert TrainerFn.FITTING == "fit" and RunningStage.SANITY_CHECKING.evaluating  # strings, as Lightning's


def _fit_twice(api: Any, root: pathlib.Path) -> dict[str, Any]:
    """A second fit on the same Trainer (a notebook cell run again), then a new Trainer's fit of that module."""
    probe = probe_callback(api.pl)
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=False, enable_checkpointing=False,
                                              callbacks=[probe]))
    module = probe_module(api.pl)
    train, val = loaders()
    trainer.fit(module, train, val)
    first, weights = dict(probe.calls), module.net.weight.detach().clone()
    probe.calls.clear()
    trainer.fit(module, train, val)
    seen = {"first": first, "second": dict(probe.calls), "unchanged": torch.equal(weights, module.net.weight),
            "progress": [trainer.current_epoch, trainer.global_step]}
    again = api.pl.Trainer(**trainer_kwargs(root, max_epochs=1, logger=False, enable_checkpointing=False))
    again.fit(module, train, val)  # shuffles from the global RNG the second fit left
    seen["then"] = floats(again.callback_metrics)
    return seen


def test_a_second_fit_on_a_trainer_goes_on_from_where_the_first_ended_as_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(_fit_twice, tmp_path)
    assert_same(records)
    mine = records["fittrain"]
    assert mine["unchanged"] and mine["progress"] == [2, 10] and "on_train_start" not in mine["second"]
    assert mine["second"]["on_sanity_check_start"] == 1 and mine["first"]["on_train_start"] == 1


def test_a_progress_bar_of_the_programs_own_replaces_the_default_as_in_lightning() -> None:
    class Dots(callbacks.ProgressBar):
        def __init__(self) -> None:
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.batches += 1

    dots = Dots()
    trainer = pl.Trainer(max_epochs=1, callbacks=[dots], logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    assert trainer.progress_bar_callback is dots
    assert not any(isinstance(cb, callbacks.TQDMProgressBar) for cb in trainer.callbacks)
    assert not any(isinstance(cb, ProgressBar) for cb in trainer.events.callbacks)  # fittrain draws no bar

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer.fit(Tiny(), DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 2)), batch_size=4))
    assert dots.batches == 3  # its hooks draw the program's bar
    with pytest.raises(ValueError, match="`enable_progress_bar=False` but found `Dots`"):
        pl.Trainer(callbacks=[Dots()], enable_progress_bar=False)
