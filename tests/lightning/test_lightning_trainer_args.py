"""fittrain.lightning.Trainer's arguments: Lightning's defaults, the loop they give next to Lightning's
(steps, epochs, validations, hooks, logged rows), and a clear error for each one fittrain cannot honour."""

from __future__ import annotations

import csv
import pathlib
from typing import Any

import pytest
import torch

import fittrain.lightning as pl
from lightning_programs import assert_same, both, floats, loaders, probe_callback, probe_module, trainer_kwargs


def _defaults(api: Any, root: pathlib.Path) -> dict[str, Any]:
    trainer = api.pl.Trainer(default_root_dir=str(root))
    return {
        "logger": type(trainer.logger).__name__, "save_dir": trainer.logger.save_dir, "name": trainer.logger.name,
        "loggers": len(trainer.loggers), "checkpoint": type(trainer.checkpoint_callback).__name__,
        "log_every_n_steps": trainer.log_every_n_steps,
        "num_sanity_val_steps": trainer.num_sanity_val_steps, "precision": trainer.precision,
        "accumulate_grad_batches": trainer.accumulate_grad_batches, "val_check_interval": trainer.val_check_interval,
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch, "world_size": trainer.world_size,
        "global_rank": trainer.global_rank, "is_global_zero": trainer.is_global_zero,
        "default_root_dir": trainer.default_root_dir, "num_nodes": trainer.num_nodes,
    }


def test_defaults_are_lightnings(tmp_path: pathlib.Path) -> None:
    records = both(lambda api, root: _defaults(api, root), tmp_path)
    # The folders differ by library; everything else must not.
    for record, library in ((records["lightning"], "lightning"), (records["fittrain"], "fittrain")):
        assert record.pop("save_dir") == record.pop("default_root_dir") == str(tmp_path / library)
    assert_same(records)
    trainer = pl.Trainer(default_root_dir=str(tmp_path))
    assert trainer.max_epochs == 1000  # neither max_epochs nor max_steps
    # Lightning's default bar is a RichProgressBar where `rich` is installed: fittrain always draws with tqdm.
    assert type(trainer.progress_bar_callback).__name__ == "TQDMProgressBar"


def _loop(kwargs: dict[str, Any], module_options: dict[str, Any] | None = None) -> Any:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        module, callback = probe_module(api.pl, **(module_options or {})), probe_callback(api.pl)
        trainer = api.pl.Trainer(**trainer_kwargs(root, callbacks=[callback], logger=api.loggers.CSVLogger(str(root)),
                                                  log_every_n_steps=kwargs.pop("log_every_n_steps", 2), **kwargs))
        trainer.fit(module, *loaders())
        rows = []
        metrics = pathlib.Path(trainer.logger.log_dir or "-") / "metrics.csv"  # fast_dev_run: a DummyLogger
        if metrics.is_file():
            with open(metrics, newline="") as file:
                rows = [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]
        return {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch,
                "callback_metrics": floats(trainer.callback_metrics), "module_calls": dict(module.calls),
                "callback_calls": dict(callback.calls), "rows": [{k: float(v) for k, v in row.items()} for row in rows],
                "weights": float(module.net.weight.sum())}
    return run


LOOPS = {
    "max_steps": {"max_steps": 7},
    "max_steps_only_epochs_unlimited": {"max_epochs": -1, "max_steps": 12},
    "accumulate": {"max_epochs": 2, "accumulate_grad_batches": 2},
    "val_check_interval_int": {"max_epochs": 2, "val_check_interval": 2},
    "val_check_interval_fraction": {"max_epochs": 2, "val_check_interval": 0.5},
    "val_check_interval_over_epochs": {"max_epochs": 2, "val_check_interval": 3, "check_val_every_n_epoch": None},
    "max_steps_mid_epoch_with_interval": {"max_steps": 7, "val_check_interval": 2},
    "check_val_every_n_epoch": {"max_epochs": 3, "check_val_every_n_epoch": 2},
    "limits": {"max_epochs": 2, "limit_train_batches": 3, "limit_val_batches": 2},
    "fraction_limits": {"max_epochs": 2, "limit_train_batches": 0.5, "limit_val_batches": 0.4},
    "no_sanity": {"max_epochs": 2, "num_sanity_val_steps": 0},
    "sanity_all": {"max_epochs": 1, "num_sanity_val_steps": -1},
    "overfit": {"max_epochs": 2, "overfit_batches": 2},
    "fast_dev_run": {"fast_dev_run": True},
    "fast_dev_run_3": {"fast_dev_run": 3},
    "clip_norm": {"max_epochs": 2, "gradient_clip_val": 0.05},
    "clip_value": {"max_epochs": 2, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "log_every_step": {"max_epochs": 1, "log_every_n_steps": 1},
    "no_logging": {"max_epochs": 1, "log_every_n_steps": 0},
}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_the_loop_matches_lightnings(name: str, tmp_path: pathlib.Path) -> None:
    records = both(lambda api, root: _loop(dict(LOOPS[name]))(api, root), tmp_path)
    assert_same(records)


def test_min_epochs_holds_back_an_early_stop_as_lightning_does(tmp_path: pathlib.Path) -> None:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        stop = api.callbacks.EarlyStopping("val_loss", patience=1, mode="max")  # val_loss falls: stops at once
        module = probe_module(api.pl)
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=6, min_epochs=3, callbacks=[stop], logger=False,
                                                  enable_checkpointing=False))
        trainer.fit(module, *loaders())
        return {"epochs": trainer.current_epoch, "stopped_epoch": stop.stopped_epoch, "wait": stop.wait_count}

    records = both(run, tmp_path)
    assert_same(records)
    assert records["fittrain"]["epochs"] == 3


def test_should_stop_in_a_batch_ends_training_after_it(tmp_path: pathlib.Path) -> None:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        def logs(module: Any, place: str, loss: Any) -> None:
            if place == "train":
                module.log("train_loss", loss)
                if module.global_step == 7:  # in the second epoch's third batch
                    module.trainer.should_stop = True
            elif place == "val":
                module.log("val_loss", loss)

        module, callback = probe_module(api.pl, logs=logs), probe_callback(api.pl)
        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=5, callbacks=[callback], logger=False,
                                                  enable_checkpointing=False))
        trainer.fit(module, *loaders())
        return {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "calls": dict(callback.calls),
                "metrics": floats(trainer.callback_metrics)}

    records = both(run, tmp_path)
    assert_same(records)
    assert records["fittrain"]["global_step"] == 8


def test_manual_optimization_counts_each_optimizer_step(tmp_path: pathlib.Path) -> None:
    def run(api: Any, root: pathlib.Path) -> dict[str, Any]:
        class TwoSteps(api.pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False
                self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

            def training_step(self, batch: Any, batch_idx: int) -> None:
                opt_a, opt_b = self.optimizers()
                for layer, opt in ((self.a, opt_a), (self.b, opt_b)):
                    loss = torch.nn.functional.mse_loss(layer(batch[0]), batch[1])
                    opt.zero_grad()
                    self.manual_backward(loss)
                    opt.step()
                self.log("seen_step", float(self.global_step))

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

        trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=False, enable_checkpointing=False))
        trainer.fit(TwoSteps(), loaders()[0])
        return {"global_step": trainer.global_step, "metrics": floats(trainer.callback_metrics)}

    records = both(run, tmp_path)
    assert_same(records)
    assert records["fittrain"]["global_step"] == 20  # 5 batches x 2 epochs x 2 optimizers


def test_automatic_optimization_fires_no_per_step_event_of_manual_optimizations(tmp_path: pathlib.Path) -> None:
    """Lightning's count of manual optimizer steps (and DDP's buffer broadcast) is a per-step callback
    that only a module with manual optimization gets: automatic fits keep the native per-step path."""
    from fittrain.trainer.events import Event

    class Plain(pl.LightningModule):
        def __init__(self, automatic: bool = True) -> None:
            super().__init__()
            self.automatic_optimization = automatic
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            if self.automatic_optimization:
                return loss
            self.optimizers().zero_grad()
            self.manual_backward(loss)
            self.optimizers().step()
            self.optimizers().step()  # Lightning counts each optimizer step
            return None

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    listening = lambda trainer: [trainer.events.listens(e)  # noqa: E731
                                 for e in (Event.TRAIN_BATCH_START, Event.BEFORE_OPTIMIZER_STEP)]
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False))
    trainer.fit(Plain(), loaders()[0])
    assert listening(trainer) == [False, False] and trainer.global_step == 5
    trainer.validate(Plain(automatic=False), loaders()[1], verbose=False)  # each stage looks at its module
    assert listening(trainer) == [True, True]
    trainer.validate(Plain(), loaders()[1], verbose=False)
    assert listening(trainer) == [False, False]
    manual = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False))
    manual.fit(Plain(automatic=False), loaders()[0])
    assert manual.global_step == 10  # 5 batches x 2 steps


def test_flags_lightning_sets_globally(tmp_path: pathlib.Path) -> None:
    before = torch.backends.cudnn.benchmark
    try:
        pl.Trainer(benchmark=True, default_root_dir=str(tmp_path))
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, precision="bf16-mixed", logger=False,
                                          enable_checkpointing=False))
    trainer.fit(probe_module(pl), loaders()[0])
    assert trainer.precision == "bf16-mixed" and trainer.accelerator.mixed_precision == "bf16"


def test_barebones_switches_the_extras_off_and_refuses_them_on(tmp_path: pathlib.Path) -> None:
    trainer = pl.Trainer(barebones=True, max_epochs=1, default_root_dir=str(tmp_path))
    assert trainer.loggers == [] and trainer.checkpoint_callback is None and trainer.num_sanity_val_steps == 0
    with pytest.raises(ValueError, match="logging is off in Trainer\\(barebones=True\\)"):
        trainer.fit(probe_module(pl), loaders()[0])
    with pytest.raises(ValueError, match="barebones=True, enable_checkpointing=True"):
        pl.Trainer(barebones=True, enable_checkpointing=True)


REFUSED = [
    ({"profiler": "simple"}, ValueError, "profiler='simple'.*accelerator.profile"),
    ({"plugins": ["x"]}, ValueError, "plugins"),
    ({"reload_dataloaders_every_n_epochs": 1}, ValueError, "reload_dataloaders_every_n_epochs=1"),
    ({"use_distributed_sampler": False}, ValueError, "use_distributed_sampler=False"),
    ({"model_registry": "model"}, ValueError, "model_registry"),
    ({"precision": "64-true"}, ValueError, "precision='64-true'.*'bf16-mixed'"),
    ({"precision": "16-mixed", "accelerator": "cpu"}, ValueError, "fp16 mixed precision needs a GPU"),
    ({"accelerator": "tpu"}, ValueError, "accelerator='tpu'.*'cpu'"),
    ({"strategy": "deepspeed"}, ValueError, "strategy='deepspeed'.*fittrain launch"),
    ({"strategy": "ddp_spawn"}, ValueError, "strategy='ddp_spawn'"),
    ({"devices": 2}, ValueError, "devices=2.*1 process.*fittrain launch --num_processes 2"),
    ({"devices": [1]}, ValueError, "devices=\\[1\\].*CUDA_VISIBLE_DEVICES"),
    ({"num_nodes": 2}, ValueError, "num_nodes=2.*1 machine"),
    ({"gradient_clip_algorithm": "sideways", "gradient_clip_val": 1.0}, ValueError, "gradient_clip_algorithm"),
    ({"gradient_clip_val": "1"}, TypeError, "gradient_clip_val"),
    ({"val_check_interval": 1.5}, ValueError, "val_check_interval"),
    ({"val_check_interval": 0.5, "check_val_every_n_epoch": None}, ValueError, "should be an integer"),
    ({"val_check_interval": 3, "accumulate_grad_batches": 2}, ValueError, "multiple of it"),
    ({"max_epochs": 0}, ValueError, "max_epochs"),
    ({"max_steps": -5}, ValueError, "max_steps"),
    ({"min_epochs": -1}, ValueError, "min_epochs"),
    ({"logger": object()}, TypeError, "Trainer\\(logger=...\\)"),
    ({"callbacks": [object()]}, TypeError, "Trainer\\(callbacks=...\\)"),
    ({"enable_checkpointing": False, "callbacks": [pl.callbacks.ModelCheckpoint()]}, ValueError,
     "enable_checkpointing=False"),
    ({"benchmark": "yes"}, ValueError, "benchmark"),
    ({"callbacks": [pl.callbacks.ModelCheckpoint(), pl.callbacks.ModelCheckpoint(monitor="val_loss")]}, ValueError,
     "2 ModelCheckpoints; fittrain.lightning takes one"),
    ({"inference_mode": 1}, ValueError, "inference_mode"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), REFUSED, ids=[str(sorted(k)) for k, _, _ in REFUSED])
def test_an_argument_fittrain_cannot_honour_is_refused_when_built(kwargs: dict[str, Any], error: type,
                                                                  message: str, tmp_path: pathlib.Path) -> None:
    with pytest.raises(error, match=message):
        pl.Trainer(default_root_dir=str(tmp_path), **kwargs)


def test_what_a_fit_cannot_honour_is_refused_when_it_starts(tmp_path: pathlib.Path) -> None:
    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(**trainer_kwargs(tmp_path, gradient_clip_val=1.0, logger=False))
    with pytest.raises(ValueError, match="not supported for manual optimization.*self.clip_gradients"):
        trainer.fit(Manual(), loaders()[0])
    train, val = loaders()
    with pytest.raises(ValueError, match="val_dataloaders.*pass one DataLoader"):
        trainer.fit(probe_module(pl), train, [val, val])
    with pytest.raises(NotImplementedError, match="No `test_step\\(\\)`"):
        pl.Trainer(**trainer_kwargs(tmp_path, logger=False)).test(Manual(), val)


def test_a_fits_missing_inputs_are_named_in_lightnings_terms(tmp_path: pathlib.Path) -> None:
    """What a Lightning program passed (or left out) is what the error names, not the native Trainer's
    arguments (`train_loader`, `resume_from`, `Checkpointer`) it maps onto."""
    from fittrain.lightning.callbacks import ModelCheckpoint

    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False))
    with pytest.raises(TypeError, match=r"^Trainer.fit\(\) received no train_dataloaders and no datamodule, and Probe "
                                        r"defines no train_dataloader\(\)"):
        trainer.fit(probe_module(pl))
    with pytest.raises(TypeError, match=r"^Trainer.validate\(\) received no dataloaders .* val_dataloader\(\)"):
        trainer.validate(probe_module(pl))
    missing = tmp_path / "epoch=0-step=5.ckpt"
    with pytest.raises(FileNotFoundError, match=rf"^Trainer.fit\(ckpt_path='{missing}'\) names a checkpoint that "
                                                 "does not exist"):
        trainer.fit(probe_module(pl), loaders()[0], ckpt_path=str(missing))
    typo = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False,
                                       callbacks=[ModelCheckpoint(monitor="val_los")]))
    with pytest.raises(ValueError, match=r"^`ModelCheckpoint\(monitor=...\)` names a metric that does not exist .* "
                                         r"Received: monitor='val_los'\. Metrics that exist: \[.*'val_loss'.*\]\. "
                                         r"Pass one of them, or return/log 'val_los' from validation_step\.\n"):
        typo.fit(probe_module(pl), *loaders())


def test_a_strategy_object_gives_the_accelerator_ddps_and_the_process_groups_arguments(tmp_path: pathlib.Path) -> None:
    import datetime
    import inspect

    from fittrain.lightning.strategies import DDPStrategy, FSDPStrategy

    strategy = DDPStrategy(find_unused_parameters=True, static_graph=False, bucket_cap_mb=10,
                           process_group_backend="gloo", timeout=datetime.timedelta(minutes=3))
    trainer = pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", strategy=strategy)
    ddp = trainer.accelerator.ddp_handler
    assert (ddp.find_unused_parameters, ddp.static_graph, ddp.bucket_cap_mb) == (True, False, 10)
    string = pl.Trainer(default_root_dir=str(tmp_path), strategy="ddp_find_unused_parameters_true")
    assert string.accelerator.ddp_handler.find_unused_parameters
    assert pl.Trainer(default_root_dir=str(tmp_path), strategy=FSDPStrategy()).accelerator.ddp_handler is None
    # Every named argument is one of Lightning's, so a program's call binds the same way.
    lightning_strategies = pytest.importorskip("lightning.pytorch.strategies")
    for ours, theirs in ((DDPStrategy, lightning_strategies.DDPStrategy),
                         (FSDPStrategy, lightning_strategies.FSDPStrategy)):
        assert set(inspect.signature(ours).parameters) - {"kwargs"} <= set(inspect.signature(theirs).parameters)


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda s: s.DDPStrategy(start_method="spawn"), ValueError, r"start_method='spawn'.*fittrain launch"),
    (lambda s: s.DDPStrategy(ddp_comm_hook=print), ValueError, r"ddp_comm_hook=.*comm_hook='fp16'"),
    (lambda s: s.DDPStrategy(find_unused=True), TypeError,
     r"DDPStrategy\(find_unused=\.\.\.\).*find_unused_parameters"),
    (lambda s: s.DDPStrategy(static_graph="yes"), TypeError, r"static_graph"),
    (lambda s: s.DDPStrategy(process_group_backend="mpi"), ValueError, r"backend=.*'gloo', 'nccl'"),
    (lambda s: s.FSDPStrategy(sharding_strategy="FULL_SHARD"), ValueError, r"sharding_strategy=.*ParallelismConfig"),
    (lambda s: s.FSDPStrategy(limit_all_gathers=True), ValueError, r"limit_all_gathers=True.*strategy='fsdp'"),
], ids=["start_method", "comm_hook", "unknown", "bad_value", "backend", "fsdp1_option", "fsdp_other"])
def test_a_strategy_option_fittrain_cannot_honour_is_refused(build: Any, error: type, message: str) -> None:
    from fittrain.lightning import strategies

    with pytest.raises(error, match=message):
        build(strategies)
