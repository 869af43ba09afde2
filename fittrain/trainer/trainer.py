"""The Trainer: `fit()` is a plain training loop on the Accelerator that fires events.

Read `Trainer.fit` and `_train_batch` top to bottom: that is the whole loop. Everything optional
(clipping, precision, checkpoints, early stopping, logging) is a callback.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import warnings
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from fittrain.trainer import evaluation
from fittrain.accelerator.accelerator import Accelerator
from fittrain.data import check_batches
from fittrain.trainer.callback_states import CallbackStates
from fittrain.checkpoint.latest import load_newest
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.step.compile import check_compile, use_compile
from fittrain.trainer.events import Callback, EventDispatcher, check_callbacks
from fittrain.trainer.manual import ManualOptimization
from fittrain.trainer.manual_config import check_automatic_optimization, parse_manual_optimizers
from fittrain.trainer.module import TrainModule
from fittrain.distributed.parallel import check_strategy
from fittrain.distributed.preemption import DEFAULT_SIGNALS, PREEMPTION_EXIT_CODE, PreemptionWatcher
from fittrain.trainer.schedules import Schedule, make_schedule, parse_optimizers
from fittrain.trackers.runs import check_run_name
from fittrain.trainer.parts import (LazyMetrics, ValidationAverager, check_accelerator, check_count, check_loader,
                            check_one_checkpointer, check_path, check_validation_interval, empty_epoch_error,
                            explain_backward_error, extract_loss, length_of, make_step_runner, warn_once)
from fittrain.trainer.runs import RunPlan, start_run


@dataclasses.dataclass
class TrainState:
    """Where training stands. Saved in every checkpoint and restored on resume.

    Attributes:
        epoch: The epoch being trained, from 0.
        global_step: Optimizer steps taken.
        batch_idx: Index of the current batch within the epoch.
        loss: The last training loss, detached (a tensor; no device sync until read).
        metrics: The latest value of each metric, as floats (converted when read).
        should_stop: Set by a callback (such as EarlyStop) to end training after this epoch; set
            during a mid-epoch validation (`val_every_n_steps`), it ends training after this batch.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    loss: torch.Tensor | None = None
    should_stop: bool = False
    raw_metrics: LazyMetrics = dataclasses.field(default_factory=LazyMetrics)
    _warned_loss: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest value of each metric as floats (reading forces the pending device syncs)."""
        floats = self.raw_metrics.as_floats()
        self._warn_if_not_finite(floats.get("train_loss"))
        return floats

    def check_loss(self) -> None:
        """Warns (once per fit) when the last training loss is NaN or infinite; one device sync."""
        loss = self.raw_metrics.get("train_loss")
        if loss is not None:
            self._warn_if_not_finite(LazyMetrics(train_loss=loss).as_floats()["train_loss"])

    def _warn_if_not_finite(self, loss: float | None) -> None:
        # Checked where the loss becomes a float anyway, never per step: that would sync the device.
        if loss is not None and not math.isfinite(loss) and not self._warned_loss:
            self._warned_loss = True
            warnings.warn(
                f"The training loss is {loss} at optimizer step {self.global_step} (epoch {self.epoch}): training "
                "diverged or a batch holds NaN/inf. Lower the learning rate, clip gradients (GradClip), check the "
                "data, or stop on it with EarlyStop(monitor='train_loss') and a val_loader. (Checked when metrics "
                "are read and at each epoch end, not every step; warned once per fit.)", stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        """The JSON-safe part of the state, for checkpoints."""
        return {"epoch": self.epoch, "global_step": self.global_step, "batch_idx": self.batch_idx,
                "should_stop": self.should_stop, "metrics": self.metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.batch_idx, self.should_stop = int(state["batch_idx"]), bool(state["should_stop"])
        self.raw_metrics = LazyMetrics(state["metrics"])


class Trainer:
    """Fits a `TrainModule` with a loop built on the Accelerator, firing callback events.

    Args:
        callbacks: Callback instances, called in list order.
        max_epochs: Stop after this many epochs. With neither limit, one epoch runs.
        max_steps: Stop after this many optimizer steps (epochs are unlimited if only this is set).
        gradient_accumulation_steps: Batches per optimizer step.
        project_dir: Root for checkpoints and logs: each fit is a run, saving into
            `checkpoints/{run_name}/checkpoint_{i}` and logging into `logs/{run_name}/`.
        resume_from: A checkpoint folder; a run folder (`checkpoints/{run_name}`: its newest intact
            checkpoint); or "latest": the newest intact checkpoint of the most recently started run
            that holds one (of `run_name`'s run, when a name is given). The resumed run goes on in
            its own folder, numbering on; a checkpoint from elsewhere starts a new run from its state.
        val_every_n_epochs: Validate at the end of every n-th epoch (when a val_loader is given).
            None means 1, unless `val_every_n_steps` is given.
        strategy: "auto", "ddp" or "fsdp".
        accelerator: A pre-built Accelerator to use instead of building one.
        preemption_signals: Signals on which fit finishes the optimizer step, saves a checkpoint
            and exits with code 75 (`PREEMPTION_EXIT_CODE`); () disables this.
        val_every_n_steps: Validate every n-th optimizer step instead, in the middle of an epoch,
            right after that step (Lightning's `val_check_interval`); there is then no validation
            at epoch ends. Exclusive with `val_every_n_epochs`.
        compile: Compile the module's forward with torch.compile: True with its defaults, or a dict
            of its keyword options (backend, mode, fullgraph, dynamic, options, disable). Parameter
            names and checkpoints stay those of the plain module. Applies to a given `accelerator`
            too; an accelerator built with `dynamo_backend` compiles even with compile=False.
        run_name: The run's name (letters, digits, '.', '_', '-'), like a Logger's `run_name`, which
            names the run too. Default: the resumed checkpoint's run, else a new name free under
            `checkpoints/` and `logs/`, `run_2026-12-01_06-30-05`. A fresh fit never writes into
            a run folder that holds checkpoints: naming one is a ValueError.

    Example:
        >>> trainer = Trainer(max_epochs=3, callbacks=[GradClip(max_norm=1.0), Logger()])
        >>> trainer.fit(module, train_loader, val_loader)
    """

    def __init__(self, callbacks: Sequence[Callback] | None = None, max_epochs: int | None = None,
                 max_steps: int | None = None, gradient_accumulation_steps: int = 1,
                 project_dir: str | os.PathLike = ".", resume_from: str | os.PathLike | None = None,
                 val_every_n_epochs: int | None = None, strategy: str = "auto",
                 accelerator: Accelerator | None = None, preemption_signals: Sequence[int | str] = DEFAULT_SIGNALS,
                 val_every_n_steps: int | None = None, compile: bool | dict[str, Any] = False,
                 run_name: str | None = None) -> None:
        self.max_epochs = check_count("max_epochs", max_epochs, optional=True)
        self.max_steps = check_count("max_steps", max_steps, optional=True)
        if self.max_epochs is None and self.max_steps is None:
            self.max_epochs = 1
        self.val_every_n_epochs, self.val_every_n_steps = check_validation_interval(val_every_n_epochs,
                                                                                  val_every_n_steps)
        check_path("resume_from", resume_from, optional=True)
        check_path("project_dir", project_dir)
        check_accelerator(accelerator)
        compile_options = check_compile(compile)
        self._given_run_name = check_run_name(run_name, "Trainer")
        # The run's name, decided at each fit (fittrain/trainer/runs.py): its checkpoints' and logs' folder.
        self.run_name: str | None = self._given_run_name
        self.resume_from = resume_from
        self.project_dir = os.fspath(project_dir)
        self.events = EventDispatcher(check_callbacks(callbacks))
        check_one_checkpointer(self.callbacks)
        self.preemption = PreemptionWatcher(preemption_signals)
        if accelerator is None:
            accelerator = Accelerator(
                gradient_accumulation_steps=check_count("gradient_accumulation_steps", gradient_accumulation_steps),
                strategy=check_strategy(strategy),
                project_config=ProjectConfiguration(self.project_dir, os.path.join(self.project_dir, "logs"),
                                                    automatic_checkpoint_naming=True))
        use_compile(accelerator, compile_options)
        self.accelerator = accelerator
        self.state = TrainState()
        self.module: TrainModule | None = None
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        # Every prepared optimizer and scheduler: [optimizer] in automatic optimization; in manual
        # optimization (fittrain/trainer/manual.py) what self.optimizers() and self.lr_schedulers() return.
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self._manual: ManualOptimization | None = None
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.lr_schedule = Schedule()  # steps the scheduler at the loop's fixed points (fittrain/trainer/schedules.py)
        self._averager: ValidationAverager | None = None
        self._val_step_interval = 0  # val_every_n_steps while a val_loader is given, else 0 (never)
        self._eval_loaders: dict[int, Any] = {}
        # Set by a Checkpointer that monitors a metric (save_top_k): the best checkpoint so far.
        self.best_checkpoint: pathlib.Path | None = None
        self.best_score: float | None = None

    @property
    def callbacks(self) -> list[Callback]:
        """The callbacks, in the order they run."""
        return self.events.callbacks

    # ----------------------------------------------------------------- the loop
    def fit(self, module: TrainModule, train_loader: Any, val_loader: Any = None) -> None:
        """Trains `module` on `train_loader`, validating on `val_loader` when given.

        Each loader is a DataLoader, or a list (any re-iterable sequence with a length) of
        ready batches, which is iterated as it is, in order, each epoch.

        Raises:
            TypeError: when `module` is not a TrainModule, or a loader is a one-shot iterator.
            ValueError: when `train_loader` is empty, or yields no batch in an epoch (a stream).
            FileNotFoundError: when `resume_from` names a missing folder (before any training).
            ValueError: when the run's name (given) names a run folder holding checkpoints, in a
                fresh fit: a fresh fit never writes into another run's folder.
        """
        resume = self._start_run()
        self._check_inputs(module, train_loader, val_loader)
        self.module, self.state = module, TrainState()
        module.attach(self)
        try:
            with self.preemption:
                self.events.fire("on_fit_start", self)
                self._setup(module, train_loader, val_loader, resume)
                while not self._finished():
                    self._run_epoch()
                self.events.fire("on_fit_end", self)
        except BaseException as exc:
            self.events.fire_exception(self, exc)
            raise

    def _run_epoch(self) -> None:
        self.events.fire("on_train_epoch_start", self)
        self.module.train()
        # A resumed epoch continues after the batches its checkpoint had consumed.
        start = self.train_loader.position.batches_consumed
        index = -1
        for index, batch in enumerate(self.train_loader.iterate(skip=start), start=start):
            self.state.batch_idx = index
            # A stop decided by a mid-epoch validation ends the epoch here, on every process alike.
            if self._train_batch(batch) or self._steps_done():
                break
            if self.accelerator.sync_gradients and self.preemption.should_stop(self.accelerator, self.state.global_step):
                self._save_and_exit()
        if index < 0 and start == 0:  # a fresh epoch without a batch: a stream that ran dry
            raise empty_epoch_error(self.state.epoch, getattr(self.train_loader, "base_loader", self.train_loader))
        every = self.val_every_n_epochs  # None with val_every_n_steps: no validation at epoch ends
        if self.val_loader is not None and every is not None and (self.state.epoch + 1) % every == 0:
            self._validate_prepared(self.val_loader)
            self.lr_schedule.after_validation(self.state.raw_metrics, epoch=self.state.epoch)
        self.lr_schedule.after_epoch(self.state.epoch)
        self.state.check_loss()
        self.events.fire("on_train_epoch_end", self)
        self.state.epoch += 1
        self.state.should_stop = bool(self.accelerator.broadcast(self.state.should_stop))

    def _train_batch(self, batch: Any) -> bool:
        """Trains on one batch; True when a validation after its step decided to stop training."""
        fire = self.events.fire
        fire("on_train_batch_start", self)
        # _automatic_step below, or ManualOptimization.train_batch (fittrain/trainer/manual.py): chosen in _setup.
        stepped = self._train_step(batch)
        # Before on_train_batch_end: a checkpoint saved there holds the validation's outcome, and a
        # resume from it continues with the next batch instead of validating again.
        stop = False
        if stepped and self._val_step_interval and self.state.global_step % self._val_step_interval == 0:
            stop = self._validate_mid_epoch()
        fire("on_train_batch_end", self)
        return stop

    def _automatic_step(self, batch: Any) -> bool:
        """Forward, backward and, at the end of an accumulation window, the optimizer step; True if it stepped."""
        acc, fire = self.accelerator, self.events.fire
        stepped = False
        with acc.accumulate(self.model):
            with acc.autocast():
                loss = extract_loss(self._run_step("training_step", batch))
            if loss is not None:
                self.state.loss = loss.detach()
                self.state.raw_metrics["train_loss"] = self.state.loss
                fire("on_before_backward", self)
                try:
                    acc.backward(loss)
                except RuntimeError as err:  # costs nothing until it raises
                    explain_backward_error(loss, err)
                    raise
                fire("on_after_backward", self)
                if acc.sync_gradients:
                    fire("on_before_optimizer_step", self)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    self.state.global_step += 1
                    self.lr_schedule.after_optimizer_step(self.state.global_step)
                    stepped = True
            else:
                warn_once(self, "training_step returned None: the batch is skipped (no backward, no step).")
        return stepped

    def _validate_mid_epoch(self) -> bool:
        """Validates after this optimizer step; returns whether to stop now, the same on every process."""
        self._validate_prepared(self.val_loader)
        self.lr_schedule.after_validation(self.state.raw_metrics, step=self.state.global_step)
        # One collective per validation, never per step: the main process's decision wins.
        self.state.should_stop = bool(self.accelerator.broadcast(self.state.should_stop))
        return self.state.should_stop


    def _save_and_exit(self) -> None:
        try:
            self.accelerator.wait_for_checkpoint()
        except Exception as err:
            # The preemption save matters more than an earlier one that failed: report it and save.
            warn_once(self, f"A background checkpoint write had failed; saving the preemption checkpoint "
                            f"anyway. The failure: {err!r}")
        # A user's Accelerator may lack automatic naming; "latest" must find this checkpoint.
        config = self.accelerator.project_configuration
        config.automatic_checkpoint_naming = True
        if config.project_dir is None:
            config.set_directories(self.project_dir)
        path = self.accelerator.save_state()
        # Every rank exits 75: none leaves before all have saved (torchrun stops the others with
        # SIGTERM as soon as one exits), and that SIGTERM then finds the signal ignored.
        self.accelerator.wait_for_everyone()
        self.preemption.mark_exiting(self.accelerator.use_distributed)
        self.accelerator.print(f"Preempted: saved {path}; resume with resume_from='latest'.")
        self.preemption.requeue_if_asked(self.accelerator.is_main_process)  # SIGUSR1 under SLURM only
        raise SystemExit(PREEMPTION_EXIT_CODE)

    def _finished(self) -> bool:
        return self.state.should_stop or self._steps_done() or (
            self.max_epochs is not None and self.state.epoch >= self.max_epochs)

    def _steps_done(self) -> bool:
        return self.max_steps is not None and self.state.global_step >= self.max_steps

    # ----------------------------------------------------------------- evaluation (fittrain/trainer/evaluation.py)
    def validate(self, module: TrainModule, loader: Any) -> dict[str, float]:
        """Runs `validation_step` over `loader` and returns the averaged metrics.

        Example:
            >>> trainer.validate(module, val_loader)
            {'val_loss': 0.12}
        """
        evaluation.check_inputs("validate", module, loader)
        evaluation.use_module(self, module)
        return self._validate_prepared(evaluation.prepare_loader(self, loader))

    def _validate_prepared(self, loader: Any) -> dict[str, float]:
        return evaluation.run_validation(self, loader)

    def test(self, module: TrainModule, loader: Any) -> dict[str, float]:
        """Runs `test_step` (without one: `validation_step`) over `loader`, after `fit` or without it.

        Returns the metrics averaged over every sample of every process, as validation does,
        named `test_*` (a scalar return is `test_loss`; `val_x` and `x` become `test_x`), and
        records them in `trainer.state.metrics`. See `fittrain.trainer.evaluation`.

        Example:
            >>> trainer.test(module, test_loader)
            {'test_loss': 0.13}
        """
        return evaluation.run_test(self, module, loader)

    def predict(self, module: TrainModule, loader: Any, all_processes: bool = False) -> Any:
        """Runs `predict_step` (by default `module(batch)`) over `loader`, after `fit` or without it.

        Returns every sample's output once, in the loader's order, on the CPU of the main process:
        tensors, also inside dicts, tuples and lists, concatenated along dim 0; lists of per-sample
        items joined into one list. The other processes get None, or the same whole result with
        `all_processes=True`. Every process must call it. See `fittrain.trainer.evaluation`.

        Example:
            >>> trainer.predict(module, DataLoader(inputs, batch_size=64))
            tensor([[0.12], [0.57], ...])
        """
        return evaluation.run_predict(self, module, loader, all_processes)

    def record(self, name: str, value: Any) -> None:
        """Records a metric (used by `TrainModule.log` and callbacks); validation values are averaged."""
        if self._averager is not None:
            self._averager.add(name, value)
        else:
            self.state.raw_metrics[name] = value.detach() if isinstance(value, torch.Tensor) else value

    # ----------------------------------------------------------------- setup and resume
    def _setup(self, module: TrainModule, train_loader: Any, val_loader: Any, resume: RunPlan) -> None:
        acc = self.accelerator
        self._prepare_optimization(module, val_loader is not None)
        self.train_loader = acc.prepare_data_loader(train_loader)
        # The Trainer autocasts the whole training_step, so the per-forward fp32 wrapper is redundant.
        acc.unwrap_model(self.model, keep_fp32_wrapper=False)
        self._run_step = make_step_runner(self.model, module)
        self.val_loader = evaluation.prepare_loader(self, val_loader) if val_loader is not None else None
        self._val_step_interval = (self.val_every_n_steps or 0) if val_loader is not None else 0
        acc.register_for_checkpointing(self.state, CallbackStates(self.callbacks))
        if resume.checkpoint is None:
            return
        if resume.newest:
            # The newest checkpoint of the run that loads: one whose files are refused only when parsed
            # (a planted pickle, garbled contents) is passed over like one that fails its checksums.
            loaded = load_newest(resume.checkpoint.parent, lambda msg: warn_once(self, msg), acc.load_state)
        else:
            loaded = acc.load_state(resume.checkpoint)
        if not resume.continues:  # a checkpoint from elsewhere: this new run numbers its own saves from 0
            acc.project_configuration.iteration = 0
        # A checkpoint saved at epoch end already finished that epoch: its loader moved on.
        self.state.epoch = max(self.state.epoch, self.train_loader.position.epoch)
        # One line, so that a run resumed from the wrong checkpoint (a smoke run's) is noticed.
        acc.print(f"Resumed from {loaded}: epoch {self.state.epoch}, optimizer step {self.state.global_step}, "
                  f"{self.train_loader.position.batches_consumed} batches into the epoch.")

    def _prepare_optimization(self, module: TrainModule, validates: bool) -> None:
        """Prepares the module with its optimizers and schedulers, and picks the batch function."""
        acc = self.accelerator
        if not check_automatic_optimization(module):  # training_step steps them itself: fittrain/trainer/manual.py
            optimizers, schedulers = parse_manual_optimizers(module)
            self.model, *prepared = acc.prepare(module, *optimizers)
            self._manual = ManualOptimization(self, prepared, schedulers)
            self.optimizers, self.schedulers = self._manual.optimizers, self._manual.schedulers
            self.optimizer, self.scheduler = self.optimizers[0], next(iter(self.schedulers), None)
            self.lr_schedule, self._train_step = Schedule(), self._manual.train_batch
            return
        optimizer, config = parse_optimizers(module)
        self.model, self.optimizer = acc.prepare(module, optimizer)
        self.lr_schedule = make_schedule(config, acc, validates, self.val_every_n_epochs, self.val_every_n_steps)
        self.scheduler, self._manual, self._train_step = self.lr_schedule.scheduler, None, self._automatic_step
        self.optimizers, self.schedulers = [self.optimizer], [self.scheduler] if self.scheduler else []

    def _start_run(self) -> RunPlan:
        """Names this fit's run, finds the checkpoint it resumes from, and points the Accelerator's
        automatic checkpoint naming at the run's folder (fittrain/trainer/runs.py)."""
        plan = start_run(self, self._given_run_name, lambda msg: warn_once(self, msg))
        self.run_name = plan.name
        return plan

    @staticmethod
    def _check_inputs(module: Any, train_loader: Any, val_loader: Any) -> None:
        if not isinstance(module, TrainModule):
            raise TypeError(f"fit() takes a TrainModule. Received: {type(module).__name__}. "
                            "Subclass fittrain.TrainModule and implement training_step and configure_optimizers.")
        check_loader("train_loader", train_loader)
        for name, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
            if loader is not None and not isinstance(loader, DataLoader):
                check_loader(name, loader)
                check_batches(loader, name)
        if length_of(train_loader) == 0:  # a stream has no length: an empty epoch is caught when it runs
            raise ValueError("fit() received an empty train_loader (0 batches): nothing to train on. "
                             "Check the dataset's length and the loader's batch_size/drop_last.")
        if val_loader is not None and not module.has_validation_step():
            module.validation_step(None)  # raises the explanatory NotImplementedError
