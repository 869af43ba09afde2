"""The Trainer: `fit()` is a plain training loop on the Accelerator that fires events.

Read `Trainer.fit` top to bottom: that is the whole loop. One batch is `optimization.train_batch`
(automatic or manual optimization, fittrain/trainer/optimization.py); evaluation runs in an
`Evaluation` (fittrain/trainer/evaluation.py). Everything optional (clipping, precision,
checkpoints, early stopping, logging) is a callback. Lightning's loop arguments live in small
modules: how many batches each loop runs (limits.py), when fit validates (validation_schedule.py),
the sanity check (sanity.py), max_time (timer.py), the parameter table (summary.py).
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import pathlib
from typing import Any, Iterator, Sequence

from torch import nn

from fittrain.accelerator.accelerator import Accelerator
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.common.checks import check_bool, check_positive_int
from fittrain.distributed.layout import ParallelismConfig
from fittrain.distributed.parallel import check_strategy
from fittrain.distributed.preemption import DEFAULT_SIGNALS, PreemptionWatcher
from fittrain.distributed.watchdog import StepWindow, check_hang_timeout, watch_steps
from fittrain.step.compile import check_compile, use_compile
from fittrain.trackers.runs import check_run_name
from fittrain.trainer.callback_states import CallbackStates
from fittrain.trainer.ckpt_path import restore_for_evaluation
from fittrain.trainer.datamodule import DataModule, DataStages
from fittrain.trainer.determinism import use_deterministic
from fittrain.trainer.evaluation import (
    Evaluation,
    as_test_metrics,
    check_fit_inputs,
    check_inputs,
    check_predictable,
    pick_test_method,
)
from fittrain.trainer.events import Callback, Event, EventDispatcher, check_callbacks, muted_in_dev_run
from fittrain.trainer.limits import LoopLimits, dev_run_line, epoch_slice
from fittrain.trainer.logged import MetricLog
from fittrain.trainer.loop_plan import LoopPlan, loop_lengths
from fittrain.trainer.manual import ManualOptimization
from fittrain.trainer.module import TrainModule
from fittrain.trainer.module_hooks import bind_module_hooks
from fittrain.trainer.optimization import AutomaticOptimization, prepare_optimization
from fittrain.trainer.parts import StepRunner, check_accelerator, check_path, empty_epoch_error, warn_once
from fittrain.trainer.preempt import save_and_exit
from fittrain.trainer.progress import say, with_progress_bar
from fittrain.trainer.runs import RunPlan, check_one_checkpointer, load_resumed, start_run
from fittrain.trainer.sanity import run_sanity_check
from fittrain.trainer.schedules import Schedule
from fittrain.trainer.timer import Timer, parse_max_time
from fittrain.trainer.train_state import TrainState

__all__ = ["Trainer", "TrainState"]


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
            that holds one (of `run_name`'s run, when a name is given); or "auto": "latest" where a
            checkpoint was saved, else a fresh start (one command for a job's first launch and its
            requeues). The resumed run goes on in its own folder, numbering on; a checkpoint from
            elsewhere starts a new run from its state.
        val_every_n_epochs: Validate at the end of every n-th epoch (when a val_loader is given).
            None means 1, unless `val_every_n_steps` is given; with it, the epochs it counts steps in.
        strategy: "auto", "ddp" or "fsdp".
        parallelism_config: A `ParallelismConfig` (Accelerate's): the processes' layout on a device
            mesh, such as HSDP's (`dp_replicate_size` x `dp_shard_size`); it picks the strategy.
        accelerator: A pre-built Accelerator to use instead of building one.
        preemption_signals: Signals on which fit finishes the optimizer step, saves a checkpoint
            and exits with code 75 (`PREEMPTION_EXIT_CODE`); () disables this.
        val_every_n_steps: Validate after optimizer steps instead, right after the step, and not at
            epoch ends: an int n after every n-th step, a float f in (0, 1] after every
            `int(f * steps per epoch)`-th (0.25: four times an epoch). Counted over the whole fit, or,
            with `val_every_n_epochs` also given, from the start of each of those epochs (Lightning's
            `val_check_interval` and `check_val_every_n_epoch`; fittrain/trainer/validation_schedule.py).
        compile: Compile the module's forward with torch.compile: True with its defaults, or a dict
            of its keyword options (backend, mode, fullgraph, dynamic, options, disable). Parameter
            names and checkpoints stay those of the plain module. Applies to a given `accelerator`
            too; an accelerator built with `dynamo_backend` compiles even with compile=False.
        enable_progress_bar: Show progress (Lightning's name): a tqdm bar per epoch and one line when
            training starts (the run, where checkpoints and logs go) and when the fit ends. A
            `ProgressBar` is added unless a callback draws progress itself (a `Logger`); False
            shows and prints nothing, a Logger's bars included.
        run_name: The run's name (letters, digits, '.', '_', '-'), like a Logger's `run_name`, which
            names the run too. Default: the resumed checkpoint's run, else a new name free under
            `checkpoints/` and `logs/`, `run_2026-12-01_06-30-05`. A fresh fit never writes into
            a run folder that holds checkpoints: naming one is a ValueError.
        limit_train_batches, limit_val_batches, limit_test_batches, limit_predict_batches: Batches
            per training epoch, validation, test and predict: None all, an int n the first n (0 skips
            the loop), a float f in [0, 1] `int(f * len(loader))` (fittrain/trainer/limits.py).
        fast_dev_run: True (1) or n: n batches of each loop, max_steps=n in one epoch, no sanity check,
            the callbacks that save checkpoints or write logs muted; one printed line says what it overrides.
        overfit_batches: 0 (off), an int or a fraction: every epoch trains and validates on the same
            first batches, read in order (overrides limit_train/val_batches).
        num_sanity_val_steps: Validation batches before training in a fresh fit (Lightning's sanity
            check, 2 there): 0 none, -1 all; metrics discarded, RNG put back (fittrain/trainer/sanity.py).
        max_time: Stop training after this long: "DD:HH:MM:SS", a timedelta or a dict of its keywords,
            checked after each optimizer step on the main process's clock (fittrain/trainer/timer.py).
        deterministic: None (torch as it is), True (torch.use_deterministic_algorithms), "warn" or False
            (fittrain/trainer/determinism.py).
        enable_model_summary: The progress display prints the parameter table (fittrain/trainer/summary.py)
            when fit starts; not without a display (enable_progress_bar=False, Logger(progress_bar=False)).
        hang_timeout: With several processes, how long a training step may wait for a rank that stopped
            answering (stopped, frozen, deadlocked) before the job ends with a message naming it:
            "auto" max(60 s, 20 x the median step), a number of seconds, or None (the collective
            timeout, 30 minutes). Saves, validation and data loading are never cut short
            (fittrain/distributed/watchdog.py).

    Example:
        >>> trainer = Trainer(max_epochs=3, callbacks=[GradClip(max_norm=1.0), Logger()])
        >>> trainer.fit(module, train_loader, val_loader)
    """

    def __init__(self, callbacks: Sequence[Callback] | None = None, max_epochs: int | None = None,
                 max_steps: int | None = None, gradient_accumulation_steps: int = 1,
                 project_dir: str | os.PathLike = ".", resume_from: str | os.PathLike | None = None,
                 val_every_n_epochs: int | None = None, strategy: str = "auto",
                 accelerator: Accelerator | None = None, preemption_signals: Sequence[int | str] = DEFAULT_SIGNALS,
                 val_every_n_steps: int | float | None = None, compile: bool | dict[str, Any] = False,
                 run_name: str | None = None, enable_progress_bar: bool = True,
                 limit_train_batches: int | float | None = None, limit_val_batches: int | float | None = None,
                 limit_test_batches: int | float | None = None, limit_predict_batches: int | float | None = None,
                 fast_dev_run: bool | int = False, overfit_batches: int | float = 0, num_sanity_val_steps: int = 0,
                 max_time: str | datetime.timedelta | dict[str, int] | None = None,
                 deterministic: bool | str | None = None, enable_model_summary: bool = True,
                 parallelism_config: ParallelismConfig | None = None,
                 hang_timeout: float | str | None = "auto") -> None:
        self.limits = LoopLimits.resolve(
            {"train": limit_train_batches, "val": limit_val_batches, "test": limit_test_batches,
             "predict": limit_predict_batches}, overfit_batches, fast_dev_run, num_sanity_val_steps,
            lambda message: warn_once(self, message))
        self.max_time = parse_max_time(max_time)  # seconds, or None
        self.lengths = lengths = loop_lengths(self.limits, self.max_time is not None, max_epochs, max_steps,
                                              val_every_n_epochs, val_every_n_steps)
        self.max_epochs, self.max_steps = lengths.max_epochs, lengths.max_steps
        self.val_every_n_epochs, self.val_every_n_steps = lengths.val_every_n_epochs, lengths.val_every_n_steps
        self.deterministic = use_deterministic(deterministic)
        self.enable_model_summary = check_bool("enable_model_summary", enable_model_summary, owner="Trainer")
        self.hang_timeout = check_hang_timeout(hang_timeout)
        check_path("resume_from", resume_from, optional=True)
        check_path("project_dir", project_dir)
        check_accelerator(accelerator)
        compile_options = check_compile(compile)
        self._given_run_name = check_run_name(run_name, "Trainer")
        # The run's name, decided at each fit (fittrain/trainer/runs.py): its checkpoints' and logs' folder.
        self.run_name: str | None = self._given_run_name
        self.resume_from = resume_from
        self.project_dir = os.fspath(project_dir)
        self.enable_progress_bar = check_bool("enable_progress_bar", enable_progress_bar, owner="Trainer")
        self._use_callbacks(callbacks)
        self.preemption = PreemptionWatcher(preemption_signals)
        if accelerator is None:
            accelerator = self._build_accelerator(gradient_accumulation_steps, strategy, parallelism_config)
        elif parallelism_config is not None:
            raise ValueError("Trainer(parallelism_config=...) and Trainer(accelerator=...) both lay out the processes. "
                             f"Received: parallelism_config={parallelism_config!r:.200}. Pass it to the Accelerator "
                             "instead: Accelerator(parallelism_config=...).")
        use_compile(accelerator, compile_options)
        self.accelerator = accelerator
        self.state = self._new_state()
        self.module: TrainModule | None = None
        self.model: nn.Module | None = None
        # Automatic or manual optimization (fittrain/trainer/optimization.py), chosen at each fit: its
        # train_batch trains one batch. The names below are what it prepared, published for callbacks.
        self.optimization: AutomaticOptimization | ManualOptimization | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        # Every prepared optimizer and scheduler: [optimizer] in automatic optimization; in manual
        # optimization (fittrain/trainer/manual.py) what self.optimizers() and self.lr_schedulers() return.
        self.optimizers: list[Any] = []
        self.schedulers: list[Any] = []
        self.lr_schedule = Schedule()  # steps the scheduler at the loop's fixed points (fittrain/trainer/schedules.py)
        self.train_loader: Any = None
        self.val_loader: Any = None
        self.batch: Any = None  # the training batch of state.batch_idx (the module's batch hooks receive it)
        self.logged = MetricLog(self)  # what self.log asked beyond the values: fittrain/trainer/logged.py
        self.data = DataStages(accelerator)  # the loaders of each call: given, or a DataModule's
        self.evaluation = Evaluation(accelerator, self._fire)  # the validation, test and predict loops
        # Set by a Checkpointer that monitors a metric (save_top_k): the best checkpoint so far.
        self.best_checkpoint: pathlib.Path | None = None
        self.best_score: float | None = None
        self._runner: StepRunner | None = None  # calls the module's step methods through the prepared model
        # The batches each loop runs and when fit validates, planned at each fit (fittrain/trainer/loop_plan.py).
        self.loops = LoopPlan(self.limits)
        self.sanity_checking = False  # True during the sanity check (fittrain/trainer/sanity.py)
        self.timer = Timer(self.max_time) if self.max_time is not None else None
        self._ends_training = self._steps_done  # what may end training after a batch: max_steps (and max_time)
        self._warned: set[str] = set()  # the messages warn_once gave already
        if self.limits.dev_run:
            say(self, dev_run_line(self.limits, list(self.lengths.overridden)))

    # Lightning's names for the batches each loop runs (an int, or inf for a stream), as last planned.
    num_training_batches = property(lambda self: self.loops.num_training_batches, doc="Batches per training epoch.")
    num_val_batches = property(lambda self: self.loops.num_val_batches, doc="Batches per validation.")
    num_sanity_val_batches = property(lambda self: self.loops.num_sanity_val_batches, doc="Sanity check batches.")
    num_test_batches = property(lambda self: self.loops.num_test_batches, doc="Batches of the last test.")
    num_predict_batches = property(lambda self: self.loops.num_predict_batches, doc="Batches of the last predict.")

    def _build_accelerator(self, gradient_accumulation_steps: Any, strategy: Any,
                           parallelism_config: ParallelismConfig | None) -> Accelerator:
        return Accelerator(
            gradient_accumulation_steps=check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps),
            strategy=check_strategy(strategy), parallelism_config=parallelism_config,
            project_config=ProjectConfiguration(self.project_dir, os.path.join(self.project_dir, "logs"),
                                                automatic_checkpoint_naming=True))

    @property
    def callbacks(self) -> list[Callback]:
        """The callbacks, in the order they run."""
        return self.events.callbacks

    def _new_state(self) -> TrainState:
        """A fresh `TrainState` (fittrain.lightning's Trainer makes it one that reads Lightning's stages too)."""
        return TrainState()

    def _use_callbacks(self, callbacks: Sequence[Callback] | None) -> None:
        """Checks `callbacks` and makes them the ones the loop's events run (with the default progress bar)."""
        callbacks = check_callbacks(callbacks)
        muted = muted_in_dev_run(callbacks) if self.limits.dev_run else []  # Lightning's fast_dev_run mutes them
        self.events = EventDispatcher(with_progress_bar(callbacks, self.enable_progress_bar, muted), muted)
        check_one_checkpointer(self.events.callbacks)  # a callback says it saves checkpoints: Callback.run_request

    def _fire(self, event: Event) -> None:
        self.events.fire(event, self)

    # ----------------------------------------------------------------- the loop
    def fit(self, module: TrainModule, train_loader: Any = None, val_loader: Any = None, *,
            datamodule: DataModule | None = None, train_dataloaders: Any = None, val_dataloaders: Any = None) -> None:
        """Trains `module` on `train_loader`, validating on `val_loader` when given.

        Each loader is a DataLoader, or a list (any re-iterable sequence with a length) of
        ready batches, which is iterated as it is, in order, each epoch. Lightning's names are
        accepted too: `train_dataloaders=`, `val_dataloaders=`, or `datamodule=` (a `DataModule`,
        fittrain/trainer/datamodule.py, instead of loaders).

        Raises:
            TypeError: when `module` is not a TrainModule, or a loader is a one-shot iterator,
                missing, or given twice (under both names, or beside a datamodule).
            ValueError: when `train_loader` is empty, or yields no batch in an epoch (a stream).
            FileNotFoundError: when `resume_from` names a missing folder (before any training).
            ValueError: when the run's name (given) names a run folder holding checkpoints, in a
                fresh fit: a fresh fit never writes into another run's folder.
        """
        resume = self._start_run()
        train_loader, val_loader = self.data.fit_loaders(module, (train_loader, train_dataloaders),
                                                         (val_loader, val_dataloaders), datamodule)
        check_fit_inputs(module, train_loader, val_loader)
        train_loader, val_loader = self.loops.fit_loaders(train_loader, val_loader, lambda msg: warn_once(self, msg))
        hooks = bind_module_hooks(module)  # checks the module's on_* methods before anything runs
        self.module, self.state, self.logged, self.batch = module, self._new_state(), MetricLog(self), None
        module.attach(self)
        self.events.use_module_hooks(hooks)
        fire = self._fire
        window = StepWindow()  # each training step's span, for the hang watchdog once set up
        try:
            with self.preemption:
                fire(Event.FIT_START)  # before prepare(): callbacks may still configure the Accelerator
                self._setup(module, train_loader, val_loader, resume)
                acc = self.accelerator
                window = watch_steps(self.hang_timeout, acc.process_index, acc.num_processes)
                run_sanity_check(self, lambda: self._validate(self.val_loader, self.loops.sanity))
                if self._finished():  # a resumed run that had ended, limit_train_batches=0: Lightning's skip
                    self._skip_training()
                else:
                    fire(Event.TRAIN_START)
                    if self.timer is not None:
                        self.timer.start(self)  # max_time counts training from here
                    self._train(window)
                    fire(Event.TRAIN_END)
                fire(Event.FIT_END)
        except BaseException as exc:
            self.events.fire_exception(self, exc)
            raise
        finally:
            window.close()
            self.logged.objects.close()
            self.data.end("fit")

    def _train(self, window: StepWindow) -> None:
        """The epochs of fit, from the first to the last batch (max_epochs, max_steps, max_time, a stop).

        What each batch needs is decided once, as the hooks are: an event nobody listens to is not
        fired, a window nothing watches is not marked, and one process asks about preemption only
        once a signal set the flag (several agree on it every few steps). This is the per-step path
        the overhead benchmark holds to the hand loop: only what a batch needs runs in it.
        """
        state, logged, schedule = self.state, self.logged, self.loops.schedule
        fire = functools.partial(self.events.fire, trainer=self)  # no Python frame of its own per event
        train_batch, mid_epoch = self.optimization.train_batch, schedule.mid_epoch
        batch_start, batch_end = self.events.listens(Event.TRAIN_BATCH_START), self.events.hooks(Event.TRAIN_BATCH_END)
        watching, preemption, several = window.watching, self.preemption, self.accelerator.num_processes > 1
        # What ends training after a batch: max_steps alone is compared here; max_time (or a subclass's
        # rule, such as fittrain.lightning's early stop) is a call.
        ends = None if self._ends_training == self._steps_done else self._ends_training
        max_steps = math.inf if self.max_steps is None else self.max_steps
        while not self._finished():
            fire(Event.TRAIN_EPOCH_START)
            self.module.train()
            start, index = self.train_loader.position.batches_consumed, -1  # a resumed epoch starts later
            # Iterated without a name: leaving the loop by an exception closes the loader's pass at once
            # (its workers stop), where a local would keep it open as long as the traceback lives.
            for index, batch in self._epoch_batches(start):
                state.batch_idx, self.batch = index, batch
                if batch_start:
                    fire(Event.TRAIN_BATCH_START)
                if watching:
                    window.begin()
                stepped = train_batch(batch)
                logged.end_batch()  # sync_dist step values: one collective for all of them
                if watching:
                    window.end()
                # Before on_train_batch_end: a checkpoint saved there holds the validation's outcome,
                # and a resume from it continues with the next batch instead of validating again.
                stop = stepped and mid_epoch and schedule.after_step(state) and self._validate_mid_epoch()
                for label, hook in batch_end:  # what fire(TRAIN_BATCH_END) does, without its frame per batch
                    try:
                        hook(self)
                    except Exception as exc:
                        exc.add_note(f"Raised in {label}.")
                        raise
                if stop or (ends() if ends else state.global_step >= max_steps):  # alike on every process
                    break
                if (several or preemption.requested) and self._preempted():  # a signal: save, exit 75
                    save_and_exit(self)
            if index < 0 and start == 0:  # a fresh epoch without a batch: a stream that ran dry
                raise empty_epoch_error(state.epoch, getattr(self.train_loader, "base_loader", self.train_loader))
            if schedule.at_epoch_end(state.epoch):
                self._validate(self.val_loader, self.loops.val)
                self.lr_schedule.after_validation(state.raw_metrics, epoch=state.epoch)
            self.lr_schedule.after_epoch(state.epoch)
            state.check_loss()
            logged.end_epoch()  # self.log(on_epoch=True) values, reduced over the epoch
            fire(Event.TRAIN_EPOCH_END)
            logged.objects.reset()  # the epoch's torchmetrics Metrics, after its end hooks as in Lightning
            state.epoch += 1
            state.should_stop = bool(self.accelerator.broadcast(state.should_stop))

    def _epoch_batches(self, start: int) -> Iterator[tuple[int, Any]]:
        """This epoch's (index, batch) pairs from batch `start` (those before it a resumed checkpoint
        had consumed), up to its `limit_train_batches`-th."""
        loader, limit = self.train_loader, self.loops.train
        if start == 0:
            self.state.epoch_start_step = self.state.global_step
        batches = loader.iterate(skip=start) if limit is None else epoch_slice(loader, start, limit)
        return enumerate(batches, start=start)

    def _validate_mid_epoch(self) -> bool:
        """Validates after this optimizer step; returns whether to stop now, the same on every process."""
        self._validate(self.val_loader, self.loops.val)
        self.lr_schedule.after_validation(self.state.raw_metrics, step=self.state.global_step)
        # One collective per validation, never per step: the main process's decision wins.
        self.state.should_stop = bool(self.accelerator.broadcast(self.state.should_stop))
        return self.state.should_stop

    def _preempted(self) -> bool:
        """Whether to save and exit now: a preemption signal came, and an optimizer step just ended."""
        return self.accelerator.sync_gradients and self.preemption.should_stop(self.accelerator,
                                                                               self.state.global_step)

    def _skip_training(self) -> None:
        """What a fit whose training is done before it starts does instead of training: nothing here."""

    def _finished(self) -> bool:
        return self.state.should_stop or self._steps_done() or self.num_training_batches == 0 or (
            self.max_epochs is not None and self.state.epoch >= self.max_epochs)

    def _steps_done(self) -> bool:
        return self.max_steps is not None and self.state.global_step >= self.max_steps

    def _steps_or_time_done(self) -> bool:
        """With max_time: max_steps, or the time spent (checked at the end of accumulation windows)."""
        return self._steps_done() or (self.accelerator.sync_gradients and self.timer.check(self))

    # ----------------------------------------------------------------- evaluation (fittrain/trainer/evaluation.py)
    def validate(self, module: TrainModule, loader: Any = None, *, dataloaders: Any = None,
                 datamodule: DataModule | None = None, ckpt_path: str | os.PathLike | None = None) -> dict[str, float]:
        """Runs `validation_step` over `loader` and returns the averaged metrics.

        The loader may be given as Lightning's `dataloaders=`, or come from `datamodule=`
        (its `val_dataloader()`), as for `test` and `predict`.

        Example:
            >>> trainer.validate(module, val_loader)
            {'val_loss': 0.12}
        """
        loader = self.data.loader("validate", loader, dataloaders, datamodule)
        try:
            check_inputs("validate", module, loader)
            self._use_module(module)
            restore_for_evaluation(self, ckpt_path, "validate")
            loader = self.evaluation.prepare_loader(loader)
            return self._validate(loader, self.loops.eval_limit("val", loader))
        finally:
            self.data.end("validate")

    def _validate(self, loader: Any, limit: int | None) -> dict[str, float]:
        """Validates on a prepared loader, its first `limit` batches when given (0: nothing runs): the
        loop of `validate`, of the sanity check and of validation during fit."""
        if limit == 0:
            return {}
        with self.evaluation.loop():
            self._fire(Event.VALIDATION_START)
            results = self.evaluation.average(self._runner, loader, "validation_step",
                                              (Event.VALIDATION_BATCH_START, Event.VALIDATION_BATCH_END), limit)
            self.state.raw_metrics.update(results)
            self._fire(Event.VALIDATION_END)
        return results

    def test(self, module: TrainModule, loader: Any = None, *, dataloaders: Any = None,
             datamodule: DataModule | None = None, ckpt_path: str | os.PathLike | None = None) -> dict[str, float]:
        """Runs `test_step` (without one: `validation_step`) over `loader`, after `fit` or without it.

        Returns the metrics averaged over every sample of every process, as validation does,
        named `test_*` (a scalar return is `test_loss`; `val_x` and `x` become `test_x`), and
        records them in `trainer.state.metrics`. See `fittrain.trainer.evaluation`.

        Raises:
            TypeError: for a module with neither test_step nor validation_step, or a bad loader.
            ValueError: when two metric names become one `test_*` name.

        Example:
            >>> trainer.test(module, test_loader)
            {'test_loss': 0.13}
        """
        loader = self.data.loader("test", loader, dataloaders, datamodule)
        try:
            check_inputs("test", module, loader)
            method = pick_test_method(module)
            self._use_module(module)
            restore_for_evaluation(self, ckpt_path, "test")
            loader = self.evaluation.prepare_loader(loader)
            limit = self.loops.eval_limit("test", loader)
            if limit == 0:  # limit_test_batches=0: no loop, as in Lightning
                return {}
            with self.evaluation.loop():
                self._fire(Event.TEST_START)
                results = as_test_metrics(self.evaluation.average(
                    self._runner, loader, method, (Event.TEST_BATCH_START, Event.TEST_BATCH_END), limit))
                self.state.raw_metrics.update(results)
                self._fire(Event.TEST_END)
            return results
        finally:
            self.data.end("test")

    def predict(self, module: TrainModule, loader: Any = None, all_processes: bool = False, *, dataloaders: Any = None,
                datamodule: DataModule | None = None, ckpt_path: str | os.PathLike | None = None) -> Any:
        """Runs `predict_step` (by default `module(batch)`) over `loader`, after `fit` or without it.

        Returns every sample's output once, in the loader's order, on the CPU of the main process:
        tensors, also inside dicts, tuples and lists, concatenated along dim 0; lists of per-sample
        items joined into one list. The other processes get None, or the same whole result with
        `all_processes=True`. Every process must call it. See `fittrain.trainer.evaluation`.

        Raises:
            TypeError: for a module with neither predict_step nor forward, a bad loader, or an
                output that is not one of the forms `predict_step` may return.
            ValueError: for a 0-d tensor among the outputs.

        Example:
            >>> trainer.predict(module, DataLoader(inputs, batch_size=64))
            tensor([[0.12], [0.57], ...])
        """
        loader = self.data.loader("predict", loader, dataloaders, datamodule)
        try:
            check_inputs("predict", module, loader)
            check_predictable(module)
            self._use_module(module)
            restore_for_evaluation(self, ckpt_path, "predict")
            loader = self.evaluation.prepare_loader(loader, even_batches=True)
            limit = self.loops.eval_limit("predict", loader)
            outputs: Any = []  # limit_predict_batches=0: no loop, as in Lightning
            if limit != 0:
                with self.evaluation.loop():
                    self._fire(Event.PREDICT_START)
                    outputs = self.evaluation.predict(self._runner, loader, limit)
                    self._fire(Event.PREDICT_END)
        finally:
            self.data.end("predict")
        # Every process gathered the whole result (all_gather); only the main one keeps it by default.
        return outputs if (all_processes or self.accelerator.is_main_process) else None

    def record(self, name: str, value: Any, **options: Any) -> None:
        """Records a metric with `self.log`'s options (used by `TrainModule.log` and callbacks): a step
        value in a training batch, a mean over the loop in evaluation (fittrain/trainer/logged.py)."""
        self.logged.log(name, value, **options)

    def _use_module(self, module: TrainModule) -> None:
        """Attaches and prepares `module` for evaluation, unless it is the module the Trainer runs (after fit)."""
        if self.module is module:
            return
        hooks = bind_module_hooks(module)
        self.module = module
        module.attach(self)
        self.events.use_module_hooks(hooks)
        self.model = self.accelerator.prepare(module)
        # Each step is autocast whole, as in fit, so the per-forward fp32 wrapper is redundant; outputs
        # then have the same dtype whether or not the module was fitted first.
        self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        self._runner = StepRunner(self.model, module, self.accelerator.distributed_strategy)

    # ----------------------------------------------------------------- setup and resume
    def _setup(self, module: TrainModule, train_loader: Any, val_loader: Any, resume: RunPlan) -> None:
        acc = self.accelerator
        self.optimization = optimization = prepare_optimization(self, module, val_loader is not None)
        self.model, self.lr_schedule = optimization.model, optimization.schedule
        self.optimizers, self.schedulers = optimization.optimizers, optimization.schedulers
        self.optimizer, self.scheduler = self.optimizers[0], next(iter(self.schedulers), None)
        self.train_loader = acc.prepare_data_loader(train_loader)
        # The Trainer autocasts the whole training_step, so the per-forward fp32 wrapper is redundant.
        acc.unwrap_model(self.model, keep_fp32_wrapper=False)
        self._runner = StepRunner(self.model, module, self.accelerator.distributed_strategy)
        self.val_loader = self.evaluation.prepare_loader(val_loader) if val_loader is not None else None
        self.logged.objects.start()  # the module's torchmetrics states travel in checkpoints
        acc.register_for_checkpointing(self.state, CallbackStates(self.events.callbacks, module, self.data.datamodule,
                                                                self.logged.objects))
        load_resumed(self, resume)
        self.loops.plan_fit(self.train_loader, self.val_loader, resume.checkpoint is None, self.lengths,
                            acc.gradient_accumulation_steps)
        self._ends_training = self._steps_done if self.timer is None else self._steps_or_time_done

    def _start_run(self) -> RunPlan:
        """Names this fit's run, finds the checkpoint it resumes from, and points the Accelerator's
        automatic checkpoint naming at the run's folder (fittrain/trainer/runs.py)."""
        plan = start_run(self, self._given_run_name, lambda msg: warn_once(self, msg))
        self.run_name = plan.name
        return plan
