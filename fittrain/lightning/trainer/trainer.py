"""Lightning's `Trainer`: its arguments, defaults and attributes over fittrain's native Trainer.

The loop is the native one (fittrain/trainer/trainer.py); this class turns Lightning's arguments
into the native Trainer's and into callbacks (fittrain/lightning/build.py), calls Lightning's stage
hooks (fittrain/lightning/stages.py), keeps Lightning's metric views (fittrain/lightning/metrics.py)
and returns what Lightning's `fit`/`validate`/`test`/`predict` return. An argument fittrain cannot
honour raises when the Trainer is built, naming it and the fittrain way (fittrain/lightning/arguments.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import torch

from fittrain.accelerator.accelerator import Accelerator
from fittrain.accelerator.seeding import seed_everything
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.common.checks import check_non_negative_int, check_positive_int
from fittrain.common.reprs import short_repr
from fittrain.distributed.parallel import check_strategy
from fittrain.lightning import arguments as args
from fittrain.lightning.build import configure_loggers, lightning_callbacks, native_callbacks, with_model_callbacks
from fittrain.lightning.callbacks.progress import TQDMProgressBar
from fittrain.lightning.connector import OptimizerSteps, Predictions
from fittrain.lightning.loggers.base import DummyLogger
from fittrain.lightning.loop import LightningLoopPlan
from fittrain.lightning.metrics import LoggedNames
from fittrain.lightning.module import LightningModule, check_lightning_module
from fittrain.lightning.properties import LightningAttributes
from fittrain.lightning.stages import LightningStages
from fittrain.lightning.trainer.states import LightningState
from fittrain.lightning.verbose import print_results
from fittrain.trainer.datamodule import DataModule
from fittrain.trainer.evaluation import as_test_name
from fittrain.trainer.parts import check_path
from fittrain.trainer.trainer import Trainer as NativeTrainer


def reset_seed() -> None:
    """Lightning's `reset_seed`: `seed_everything(PL_GLOBAL_SEED)` again, when a seed was set."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None:
        seed_everything(int(seed))


_PRECISION_NAMES = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}


class Trainer(LightningAttributes, NativeTrainer):
    """Lightning's `Trainer(...)` (keyword arguments only, Lightning's defaults), running fittrain's loop.

    Lightning's arguments map onto the native Trainer (max_epochs/max_steps, accumulate_grad_batches,
    val_check_interval, check_val_every_n_epoch, limit_*_batches, fast_dev_run, overfit_batches,
    num_sanity_val_steps, max_time, deterministic, default_root_dir) and onto callbacks (precision ->
    MixedPrecision, gradient_clip_val -> GradClip, logger -> the loggers, enable_checkpointing ->
    ModelCheckpoint, ...). Processes are started by `fittrain launch` or torchrun, not by the Trainer:
    `devices`/`num_nodes` must describe that job. docs/migration.md has the table of every argument.

    Raises:
        ValueError: for an argument fittrain.lightning does not support, naming the fittrain way.
        TypeError: for a logger or callback that is not one of fittrain.lightning's (or fittrain's).
    """

    def __init__(self, *, accelerator: Any = "auto", strategy: Any = "auto", devices: Any = "auto",
                 num_nodes: int = 1, precision: Any = None, logger: Any = None, callbacks: Any = None,
                 fast_dev_run: int | bool = False, max_epochs: int | None = None, min_epochs: int | None = None,
                 max_steps: int = -1, min_steps: int | None = None, max_time: Any = None,
                 limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
                 overfit_batches: int | float = 0.0, val_check_interval: int | float | None = None,
                 check_val_every_n_epoch: int | None = 1, num_sanity_val_steps: int | None = None,
                 log_every_n_steps: int | None = None, enable_checkpointing: bool | None = None,
                 enable_progress_bar: bool | None = None, enable_model_summary: bool | None = None,
                 accumulate_grad_batches: int = 1, gradient_clip_val: int | float | None = None,
                 gradient_clip_algorithm: str | None = None, deterministic: bool | str | None = None,
                 benchmark: bool | None = None, inference_mode: bool = True, use_distributed_sampler: bool = True,
                 profiler: Any = None, detect_anomaly: bool = False, barebones: bool = False, plugins: Any = None,
                 sync_batchnorm: bool = False, reload_dataloaders_every_n_epochs: int = 0,
                 default_root_dir: Any = None, enable_autolog_hparams: bool = True,
                 model_registry: str | None = None) -> None:
        given = dict(locals())
        args.check_refused(given)
        for flag in ("inference_mode", "detect_anomaly", "barebones", "sync_batchnorm", "enable_autolog_hparams"):
            args.check_flag(flag, given[flag], (True, False))
        processes = args.processes(accelerator, strategy, devices, num_nodes)
        defaults = args.opt_out_defaults(given)
        on_cpu = processes.cpu or not torch.cuda.is_available()
        mixed = args.precision_of(precision, on_cpu)
        max_epochs_native, max_steps_native = args.loop_limits(max_epochs, max_steps, max_time)
        self.default_root_dir = os.getcwd() if default_root_dir is None else os.fspath(default_root_dir)
        self._processes, self._cpu = processes, processes.cpu
        self.logged_names = LoggedNames()
        self.predictions = Predictions()
        self.optimizer_steps = OptimizerSteps()
        self._loggers = configure_loggers(defaults["logger"], self.default_root_dir)
        self._versions_settled = False
        self._lightning_module: Any = None
        self._datamodule: Any = None
        self._stage: str | None = None
        self._running = False  # a stage runs (fit, validate, test, predict): trainer.state.stage
        self._progress: Any = None  # where the last completed fit ended: the next fit goes on from there
        if fast_dev_run and self._loggers:
            self._loggers = [DummyLogger()]  # Lightning swaps them for a logger that writes nothing
        self.lightning_callbacks, given_native = lightning_callbacks(
            callbacks, defaults["enable_checkpointing"], defaults["enable_progress_bar"],
            defaults["enable_model_summary"])
        clip = args.gradient_clipping(gradient_clip_val, gradient_clip_algorithm)
        self._remember(given, defaults, mixed, clip)
        options = {"gradient_clip_val": clip[0], "gradient_clip_algorithm": clip[1], "precision": mixed,
                   "min_epochs": args.check_minimum("min_epochs", min_epochs),
                   "min_steps": args.check_minimum("min_steps", min_steps)}
        natives = native_callbacks(self, self.lightning_callbacks, given_native, options)
        self._natives_given, self._native_options = given_native, options  # kept for configure_callbacks
        self._manual = False  # whether the callbacks count a manual module's optimizer steps (ManualSteps)
        val_epochs, val_steps = args.validation_interval(val_check_interval, check_val_every_n_epoch,
                                                         accumulate_grad_batches)
        super().__init__(
            callbacks=natives, max_epochs=max_epochs_native, max_steps=max_steps_native,
            gradient_accumulation_steps=accumulate_grad_batches, project_dir=self.default_root_dir,
            val_every_n_epochs=val_epochs, val_every_n_steps=val_steps, strategy=processes.strategy,
            # fittrain's bar is TQDMProgressBar's; a ProgressBar of the program's own draws in its hooks instead.
            enable_progress_bar=any(isinstance(cb, TQDMProgressBar) for cb in self.lightning_callbacks),
            limit_train_batches=limit_train_batches,
            limit_val_batches=limit_val_batches, limit_test_batches=limit_test_batches,
            limit_predict_batches=limit_predict_batches, fast_dev_run=fast_dev_run, overfit_batches=overfit_batches,
            num_sanity_val_steps=defaults["num_sanity_val_steps"], max_time=max_time, deterministic=deterministic,
            enable_model_summary=False)  # ModelSummary prints it, with its max_depth
        if max_epochs_native is None and max_steps_native is None and max_time is None:
            self.max_epochs = None  # max_epochs=-1: no limit (the native default would be one epoch)
        self.data = LightningStages(self)
        self.loops = LightningLoopPlan(self.limits, self)  # epoch-end validations after whole epochs only
        args.apply_benchmark(benchmark)

    def _remember(self, given: dict[str, Any], defaults: dict[str, Any], mixed: str,
                  clip: tuple[float | None, str | None]) -> None:
        """Lightning's attributes for its arguments, as a program reads them back."""
        self.accumulate_grad_batches = given["accumulate_grad_batches"]
        self.gradient_clip_val, self.gradient_clip_algorithm = clip
        self.log_every_n_steps = check_non_negative_int("log_every_n_steps", defaults["log_every_n_steps"],
                                                        owner="Trainer")
        self.val_check_interval = 1.0 if given["val_check_interval"] is None else given["val_check_interval"]
        self.check_val_every_n_epoch = given["check_val_every_n_epoch"]
        self.num_sanity_val_steps = defaults["num_sanity_val_steps"]
        self.min_epochs, self.min_steps = given["min_epochs"], given["min_steps"]
        self.precision = _PRECISION_NAMES[mixed]
        self.barebones = given["barebones"]
        self.enable_autolog_hparams = given["enable_autolog_hparams"]
        self.num_nodes, self.num_devices = self._processes.num_nodes, self._processes.num_devices
        self._detect_anomaly = given["detect_anomaly"]
        self._sync_batchnorm = given["sync_batchnorm"]

    def _build_accelerator(self, gradient_accumulation_steps: Any, strategy: Any,
                           parallelism_config: Any) -> Accelerator:
        """The native Trainer's Accelerator, on the CPU for accelerator="cpu", with the DDP and process group
        arguments the strategy gives ("ddp_find_unused_parameters_true", `DDPStrategy(...)`)."""
        handlers = list(self._processes.kwargs_handlers) or None
        return Accelerator(
            gradient_accumulation_steps=check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps),
            strategy=check_strategy(strategy), cpu=self._cpu, kwargs_handlers=handlers,
            parallelism_config=parallelism_config,
            project_config=ProjectConfiguration(self.project_dir, os.path.join(self.project_dir, "logs"),
                                                automatic_checkpoint_naming=True))

    # ----------------------------------------------------------------- stages
    def fit(self, model: LightningModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: Any = None, weights_only: bool | None = None) -> None:
        """Lightning's `fit`: trains `model`, resuming from `ckpt_path` (a checkpoint folder, "last" or "best")."""
        if isinstance(train_dataloaders, DataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        args.check_loaders("train_dataloaders", train_dataloaders)
        args.check_loaders("val_dataloaders", val_dataloaders)
        self._start_stage("fit", model, datamodule)
        args.check_clipping(model, self.gradient_clip_val)
        resume_from = self._resume_path(ckpt_path)
        args.check_strict_loading(model, "fit", resume_from)
        before, self.resume_from = self.resume_from, resume_from
        try:
            with self._fit_context(model), self._running_stage():
                super().fit(model, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                            datamodule=datamodule)
            self._progress = self.state
        finally:
            self.resume_from = before

    def validate(self, model: LightningModule | None = None, dataloaders: Any = None, ckpt_path: Any = None,
                 verbose: bool = True, datamodule: DataModule | None = None,
                 weights_only: bool | None = None) -> list[dict[str, float]]:
        """Lightning's `validate`: `[{name: value}]`, the names logged with logger=True."""
        model, ckpt_path, datamodule = self._evaluation_inputs("validate", model, ckpt_path, dataloaders, datamodule)
        with self._running_stage():
            super().validate(model, dataloaders=dataloaders, datamodule=datamodule, ckpt_path=ckpt_path)
        return self._results(verbose, "Validate")

    def test(self, model: LightningModule | None = None, dataloaders: Any = None, ckpt_path: Any = None,
             verbose: bool = True, datamodule: DataModule | None = None,
             weights_only: bool | None = None) -> list[dict[str, float]]:
        """Lightning's `test`: `[{name: value}]`, the names logged with logger=True, as logged (no `test_` prefix)."""
        model, ckpt_path, datamodule = self._evaluation_inputs("test", model, ckpt_path, dataloaders, datamodule)
        if not model.has_test_step():
            raise NotImplementedError(f"No `test_step()` method defined to run `Trainer.test`: {type(model).__name__} "
                                      "must implement test_step(self, batch, batch_idx).")
        with self._running_stage():
            results = super().test(model, dataloaders=dataloaders, datamodule=datamodule, ckpt_path=ckpt_path)
        raw = self.state.raw_metrics
        for name in list(self.logged_names.callback):  # the native test names them test_*: put them back
            if as_test_name(name) in results:
                raw[name] = results[as_test_name(name)]
        return self._results(verbose, "Test")

    def predict(self, model: LightningModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None, ckpt_path: Any = None,
                weights_only: bool | None = None) -> list[Any] | None:
        """Lightning's `predict`: this process's `predict_step` output of each batch, in a list."""
        model, ckpt_path, datamodule = self._evaluation_inputs("predict", model, ckpt_path, dataloaders, datamodule)
        self.predictions.outputs = []
        try:
            with self._running_stage():
                super().predict(model, dataloaders=dataloaders, datamodule=datamodule, ckpt_path=ckpt_path,
                                all_processes=True)
            outputs = self.predictions.outputs
        finally:
            self.predictions.outputs = None
        return None if return_predictions is False else outputs

    def save_checkpoint(self, filepath: Any, weights_only: bool = False, storage_options: Any = None) -> None:
        """Lightning's: saves the fitted state (every process must call it), as a fittrain checkpoint
        folder at `filepath` (atomic and verified; `load_from_checkpoint` and `fit(ckpt_path=)` read it).

        Raises:
            ValueError: for `weights_only=True` or `storage_options`, which fittrain.lightning does not take.
            RuntimeError: before a fit, when there is no training state to save.
        """
        if weights_only or storage_options is not None:
            raise ValueError("Trainer.save_checkpoint(weights_only=True / storage_options=...) is not supported by "
                             "fittrain.lightning: a checkpoint holds the whole training state (its model.safetensors "
                             "holds the weights). Use trainer.accelerator.save_model(model, folder) for weights alone.")
        if self.optimization is None:
            raise RuntimeError("Saving a checkpoint is only possible after `trainer.fit(...)` has set up the training "
                               "state. Call fit first.")
        config = self.accelerator.project_configuration
        automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False  # at filepath
        try:
            self.accelerator.save_state(os.fspath(filepath))
        finally:
            config.automatic_checkpoint_naming = automatic

    def _setup(self, *args: Any, **kwargs: Any) -> None:
        """The native setup, then Lightning's stop after any batch that sets `should_stop` (once the
        `min_*` limits are reached): the native loop checks it at epoch ends and after validations."""
        super()._setup(*args, **kwargs)
        native_end = self._ends_training
        self._ends_training = lambda: native_end() or (self.state.should_stop and self._can_stop_early())

    def _can_stop_early(self) -> bool:
        return self.state.epoch >= (self.min_epochs or 0) and self.state.global_step >= (self.min_steps or 0)

    # ----------------------------------------------------------------- helpers
    def _start_stage(self, stage: str, model: Any, datamodule: Any) -> None:
        if not isinstance(model, LightningModule):
            raise TypeError(f"`model` must be a `LightningModule` (fittrain.lightning.LightningModule). Received: "
                            f"{type(model).__name__}.")
        check_lightning_module(model)
        self._attach_model_callbacks(model)
        if self._processes.strategy != "auto" or self._processes.num_devices * self._processes.num_nodes > 1:
            reset_seed()  # Lightning's DDP and FSDP strategies seed again from PL_GLOBAL_SEED at each stage
        self.logged_names.reset()
        self._stage, self._lightning_module = stage, model
        if datamodule is not None:
            self._datamodule = datamodule
            if isinstance(datamodule, DataModule):
                datamodule.trainer = self

    @contextlib.contextmanager
    def _running_stage(self) -> Iterator[None]:
        """Marks a stage as running (Lightning's `trainer.state.stage`, `trainer.training`, ...)."""
        self._running = True
        try:
            yield
        finally:
            self._running = False

    def _new_state(self) -> LightningState:
        """The native `TrainState`, reading Lightning's `fn`, `stage` and `status` off this Trainer. A fit
        after a completed one goes on from where it ended, as Lightning's Trainer keeps its progress:
        with max_epochs reached it trains nothing (a checkpoint given with ckpt_path still wins)."""
        state = LightningState(trainer=self)
        previous = getattr(self, "_progress", None)
        if previous is not None and self._stage == "fit":
            state.epoch, state.global_step, state.batch_idx = previous.epoch, previous.global_step, previous.batch_idx
            state.epoch_start_step, state.should_stop = previous.epoch_start_step, previous.should_stop
        return state

    def _skip_training(self) -> None:
        """Lightning's fit with nothing left to train still builds the training loader's iterator, which
        draws its base seed from the global RNG (or the loader's generator): drawn here too, so that
        later shuffles match Lightning's."""
        loader = getattr(self.train_loader, "base_loader", self.train_loader)
        if isinstance(loader, torch.utils.data.DataLoader):
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)

    def _attach_model_callbacks(self, model: LightningModule) -> None:
        """Lightning's `configure_callbacks()`, called as each stage starts: what it returns joins the
        callbacks, replacing those of the same class (`with_model_callbacks`), and the loop's events
        then run the new list; so does a module with manual optimization after one without, and back."""
        returned = model.configure_callbacks()
        manual = not model.automatic_optimization  # its steps are counted per step (connector.ManualSteps)
        if not returned and manual == self._manual:
            return
        if returned:
            self.lightning_callbacks = with_model_callbacks(self.lightning_callbacks, returned, type(model).__name__)
        self._manual = manual
        self._use_callbacks(native_callbacks(self, self.lightning_callbacks, self._natives_given,
                                             self._native_options, manual))

    def _evaluation_inputs(self, stage: str, model: Any, ckpt_path: Any, loaders: Any,
                           datamodule: Any) -> tuple[Any, Any, Any]:
        """The module (the fitted one when None) and Lightning's choice of checkpoint: "best" when no
        module is given after a fit with a ModelCheckpoint that saved."""
        if isinstance(loaders, DataModule):
            datamodule, loaders = loaders, None
        args.check_loaders("dataloaders", loaders)
        given = model is not None
        model = model if given else self._lightning_module
        if model is None:
            raise TypeError(f"`Trainer.{stage}()` requires a `LightningModule` when it hasn't been passed in a "
                            "previous run. Pass the model.")
        if ckpt_path is None and not given and self.checkpoint_callback is not None \
                and self.checkpoint_callback.best_model_path:
            ckpt_path = "best"
        args.check_strict_loading(model, stage, ckpt_path)
        self._start_stage(stage, model, datamodule)
        return model, ckpt_path, datamodule

    def _resume_path(self, ckpt_path: Any) -> Any:
        """fit's `ckpt_path` as the native `resume_from`: a folder; "best", the ModelCheckpoint's best save;
        "last", its `last` link (or one in its folder), else, as in Lightning, none (a warning, a fresh fit)."""
        callback = self.checkpoint_callback
        if ckpt_path == "best":
            if callback is None or not callback.best_model_path:
                raise ValueError('`.fit(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save the '
                                 "best model (or saved nothing yet). Pass a checkpoint folder, or ckpt_path='last'.")
            return callback.best_model_path
        if ckpt_path != "last":
            if ckpt_path is not None:
                _check_exists(ckpt_path, self.project_dir)
            return ckpt_path
        found = callback.last_model_path if callback is not None else ""
        if not found and callback is not None:
            folder = callback.resolve_dirpath(self)
            names = [name for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                     if callback.CHECKPOINT_NAME_LAST in name]
            found = max((os.path.join(folder, name) for name in names), key=os.path.getmtime, default="")
        if not found:
            warnings.warn('.fit(ckpt_path="last") is set, but there is no last checkpoint available. No checkpoint '
                          "will be loaded: the fit starts fresh.", stacklevel=3)
        return found or None

    @contextlib.contextmanager
    def _fit_context(self, model: Any) -> Any:
        if self._sync_batchnorm and self.accelerator.num_processes > 1:
            torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        with torch.autograd.set_detect_anomaly(self._detect_anomaly) if self._detect_anomaly \
                else contextlib.nullcontext():
            yield

    def _results(self, verbose: bool, title: str) -> list[dict[str, float]]:
        results = self.logged_names.loop_results(self.state.raw_metrics)
        if verbose and self.is_global_zero:
            print_results(title, results)
        return [results]

    def settle_logger_versions(self) -> None:
        """Gives every logger the version the main process chose (the others may see other folders)."""
        if self._versions_settled:
            return
        self._versions_settled = True
        versions = [getattr(logger, "version", None) for logger in self._loggers]
        if self.accelerator.num_processes > 1:
            versions = self.accelerator.broadcast(versions)
        for logger, version in zip(self._loggers, versions):
            settle = getattr(logger, "_settle_version", None)
            if settle is not None and version is not None:
                settle(version)


def _check_exists(ckpt_path: Any, project_dir: str | os.PathLike) -> None:
    """Refuses fit's `ckpt_path` when it names nothing (relative to the working directory or to
    `default_root_dir`), in Lightning's terms: the native error would name `resume_from`."""
    check_path("ckpt_path", ckpt_path)
    if not any(os.path.lexists(p) for p in (ckpt_path, os.path.join(project_dir, ckpt_path))):
        raise FileNotFoundError(f"Trainer.fit(ckpt_path={short_repr(os.fspath(ckpt_path), 300)}) names a checkpoint "
                                "that does not exist. Pass the path of one a ModelCheckpoint saved (such as "
                                "'lightning_logs/version_0/checkpoints/epoch=1-step=16.ckpt'), 'last' or 'best'.")
