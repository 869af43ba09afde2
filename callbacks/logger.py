"""Logger: metrics, learning rates and hyperparameters to experiment trackers (TensorBoard by
default), one folder per run; written by the main process only. It owns a ProgressBar
(fittrain/trainer/progress.py) and shows the values it logs on it."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from fittrain.common.checks import check_bool, check_positive_int
from fittrain.common.reprs import short_repr
from fittrain.trackers.base import NoOpTracker, RunInfo
from fittrain.trackers.registry import check_kwargs, open_trackers, resolve_trackers
from fittrain.trackers.runs import check_run_name
from fittrain.trainer.events import Callback, RunRequest
from fittrain.trainer.progress import ProgressBar
from fittrain.trainer.runs import run_hparams

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


class Logger(Callback):
    """Writes metrics, learning rates, throughput and hyperparameters to experiment trackers, and
    shows a progress bar per epoch and per validation.

    Each run writes into its own folder, `{log_dir}/{run name}` (TensorBoard then shows one curve
    per run), through the trackers of `log_with` (`fittrain.trackers`: "tensorboard", "csv",
    "jsonl", "wandb", "mlflow", or tracker instances). The run name is the Trainer's
    (`trainer.run_name`), which also names the run's checkpoint folder, so a resumed run continues
    its run's folder; what the interrupted run wrote after its checkpoint is replaced by what the
    resumed run writes again (TensorBoard's purge step). A new run first
    records its hyperparameters: the Trainer's arguments, the module's `hparams` dict if it has
    one, and `hparams`.

    Every `every_n_steps` optimizer steps it writes every metric of `trainer.state.metrics`
    (the name is the metric's, the step is `global_step`), the learning rate and
    `throughput/steps_per_sec` and `throughput/samples_per_sec`, measured since the previous
    logging point. The learning rate is `lr` (and `lr/group_{i}` when the optimizer has several
    parameter groups); with several optimizers it is `lr/opt_{i}` (and `lr/opt_{i}/group_{j}`),
    by their position in `configure_optimizers`. The training metrics are also written before
    each validation and at the end of the fit, so short runs are logged too. Validation metrics
    are written once, when validation ends, at the current `global_step`, and are not repeated
    at later training points (nor are the metrics a resumed run restored from its checkpoint).

    Per batch it only advances the bar and compares the step with `every_n_steps`: metrics are
    read (a device sync each) at logging points only, and the bar redraws at most ten times a
    second. On other processes than the main one it does nothing.

    Args:
        log_dir: The folder holding the run folders. Default: the Accelerator's `logging_dir`,
            which is `{project_dir}/logs`.
        every_n_steps: Optimizer steps between logging points.
        progress_bar: Show tqdm bars (loss, lr, it/s; a transient one during validation): the
            Logger owns a `ProgressBar` and shows what it logs on it.
        log_with: The trackers: "all", a name, a `LoggerType`, a tracker instance, or a list.
        run_name: This run's name (letters, digits, '.', '_', '-'), as `Trainer(run_name=...)`: it
            names the run's log folder and its checkpoint folder. Default: the resumed run's, else
            the start time, `run_2026-12-01_06-30-05` (with `_2`, ... if taken). A fresh run
            reusing the name of a run without checkpoints replaces that run's points.
        hparams: More hyperparameters to record (they win over the Trainer's of the same name).
        project_name: The project for wandb and the experiment for mlflow. Default: the name of
            the project folder.
        init_kwargs: Keyword arguments per tracker name, e.g. `{"wandb": {"entity": "team"}}`.

    Raises:
        ValueError: for `every_n_steps` that is not a positive integer, a flag that is not a bool,
            an unknown tracker name or a bad `run_name`.
        TypeError: for `hparams` that is not a dict, or `log_with`/`init_kwargs` of the wrong type.
        ImportError: for a tracker whose package is not installed (naming the pip extra).

    Example:
        >>> Trainer(callbacks=[Logger(log_with=["tensorboard", "csv"])], project_dir="runs/a").fit(module, loader)
        >>> # then: tensorboard --logdir runs/a/logs ; runs/a/logs/run_.../metrics.csv
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, every_n_steps: int = 10,
                 progress_bar: bool = True, log_with: Any = "tensorboard", run_name: str | None = None,
                 hparams: dict[str, Any] | None = None, project_name: str | None = None,
                 init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        check_positive_int("every_n_steps", every_n_steps, owner="Logger")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"`Logger(log_dir=...)` must be a folder path or None. Received: log_dir={log_dir!r}.")
        if hparams is not None and not isinstance(hparams, dict):
            raise TypeError(f"`Logger(hparams=...)` must be a dict or None. Received: hparams={short_repr(hparams)} "
                            f"({type(hparams).__name__}). Pass e.g. hparams={{'lr': 3e-4, 'batch_size': 32}}.")
        if project_name is not None and not isinstance(project_name, str):
            raise TypeError(f"`Logger(project_name=...)` must be a str or None. Received: project_name="
                            f"{short_repr(project_name)}.")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.every_n_steps = every_n_steps
        self.progress_bar = check_bool("progress_bar", progress_bar, owner="Logger")
        self.log_with = resolve_trackers(log_with, "Logger(log_with=...)")
        self.run_name = check_run_name(run_name)
        self.hparams = hparams
        self.project_name = project_name
        self.init_kwargs = check_kwargs(init_kwargs, self.log_with, "Logger(init_kwargs=...)")
        # Until on_fit_start decides otherwise, the logger is silent: disabled bars, no trackers.
        self._active = False
        self._progress = ProgressBar(progress_bar)
        self.trackers: list[Any] = []  # this run's trackers (NoOpTrackers on other processes)
        self._writers: list[Any] = []  # their log_scalars, called at every logging point
        self._run: RunInfo | None = None
        self._trainer: Any = None
        self._before_validation: dict[str, Any] = {}
        self._written: dict[str, Any] = {}  # metric values written already (by identity): not repeated
        self._at_step: tuple[int, dict[str, float]] = (-1, {})  # the last step written, and its points
        self._replay: tuple[int, dict[str, float]] | None = None  # a resumed run's step and its saved points
        self._restored_points: tuple[int, dict[str, float]] = (-1, {})  # from the checkpoint a resume loaded
        self._last_step = 0
        self._mark = (0.0, 0)  # (perf_counter time, global_step) at the last logging point
        self._batches = 0  # batches since that point

    # ----------------------------------------------------------------- lifecycle
    def run_request(self) -> RunRequest:
        """The run's name given here (`run_name`), `log_dir`, where a new run's name must be free, and
        that it draws the progress (its own ProgressBar): the Trainer adds no default bar."""
        return RunRequest(name=self.run_name, log_dir=self.log_dir, writes_logs=bool(self.log_with),
                          shows_progress=True)

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Decides what this process shows and writes; the run starts with the first epoch, once a
        resumed checkpoint has told which run this is."""
        is_main = trainer.accelerator.is_main_process
        self._active = is_main and (bool(self.log_with) or self.progress_bar)
        self._progress.on_fit_start(trainer)
        self._trainer = trainer  # for state_dict, which a checkpoint calls without it
        self._run, self._restored_points = None, (-1, {})
        self._written, self._replay = {}, None

    def state_dict(self) -> dict[str, Any]:
        """The points written at the checkpoint's step, and the run's name (for the record: a resumed
        run's name comes from its checkpoint's run folder).

        The training point of the checkpoint's step is written first if it was not yet: a resume
        that replays this step (its epoch-end validation) then rewrites exactly what was there.
        """
        if self._run is None:
            return {}
        trainer = self._trainer
        if self._active and trainer is not None and trainer.state.global_step != self._last_step:
            self._log_training(trainer, trainer.state.global_step)
        at, points = self._at_step
        return {"run_name": self._run.name, "step": at, "points": dict(points)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Remembers the resumed run's last points (the Trainer names the run)."""
        self._restored_points = (int(state.get("step", -1)), dict(state.get("points", {})))

    def on_train_start(self, trainer: "Trainer") -> None:
        """Says which run trains and where its checkpoints and logs go (its ProgressBar's line)."""
        self._progress.on_train_start(trainer)

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Starts the run at the first epoch; starts this epoch's progress bar and the throughput clock."""
        if self._run is None:
            self._start_run(trainer)
        self._progress.on_train_epoch_start(trainer)
        self._last_step = trainer.state.global_step
        self._restart_clock(trainer.state.global_step)

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """Advances the bar; at every `every_n_steps`-th optimizer step, logs the training metrics."""
        self._progress.on_train_batch_end(trainer)
        self._batches += 1
        step = trainer.state.global_step
        # Accumulating batches repeat a step; it is logged once.
        if step % self.every_n_steps or step == self._last_step or not self._active:
            return
        self._log_training(trainer, step)

    def on_validation_start(self, trainer: "Trainer") -> None:
        """Logs the training metrics reached so far, remembers which metric values exist, and
        starts the validation bar. The sanity check's validation writes nothing: its metrics are discarded."""
        if not self._active:
            return
        self._progress.on_validation_start(trainer)
        if trainer.sanity_checking:
            return
        if trainer.state.global_step != self._last_step:
            self._log_training(trainer, trainer.state.global_step)
        trainer.state.raw_metrics.as_floats()  # converts pending tensors in place, so identities stay stable
        self._before_validation = dict(trainer.state.raw_metrics)

    def on_validation_batch_end(self, trainer: "Trainer") -> None:
        """Advances the validation bar."""
        self._progress.on_validation_batch_end(trainer)

    def on_validation_end(self, trainer: "Trainer") -> None:
        """Writes the metrics this validation produced and shows them on the bar (not the sanity check's)."""
        self._progress.on_validation_end(trainer)
        if not self._active or trainer.sanity_checking:
            return
        # Validation stores new float objects; anything else in the metrics is the same object as before.
        raw = trainer.state.raw_metrics
        fresh = {name: value for name, value in raw.items()
                 if self._before_validation.get(name) is not value and name not in trainer.logged.hidden}
        self._written.update(fresh)
        scalars = {name: float(value) for name, value in fresh.items()}
        self._write(scalars, trainer.state.global_step, flush=True)  # a live TensorBoard then sees each validation
        self._progress.show({name: f"{value:.4g}" for name, value in scalars.items()})

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """Writes the epoch's `self.log(on_epoch=True)` values and closes this epoch's bar."""
        if self._active:
            raw, hidden = trainer.state.raw_metrics, trainer.logged.hidden
            raw.as_floats()  # converts pending tensors in place, so the identities kept below stay those written
            epoch = {name: raw[name] for name in trainer.logged.epoch_names if name not in hidden}
            self._written.update(epoch)  # not repeated at the next logging point
            if epoch:
                self._write({name: float(value) for name, value in epoch.items()}, trainer.state.global_step)
        self._progress.on_train_epoch_end(trainer)

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Logs the last training metrics, then closes the bar (which says where the fit stopped) and the writer."""
        if self._active and trainer.state.global_step != self._last_step:
            self._log_training(trainer, trainer.state.global_step)
        self._progress.on_fit_end(trainer)
        self._close()

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Closes the bar and the writer, keeping what was written so far."""
        self._close()

    # ----------------------------------------------------------------- helpers
    def _start_run(self, trainer: "Trainer") -> None:
        """Names the run, opens its trackers and, for a new run, records its hyperparameters."""
        acc = trainer.accelerator
        logs_dir = self.log_dir or acc.logging_dir or os.path.join(trainer.project_dir, "logs")
        name = trainer.run_name  # decided by the Trainer at the start of fit: its checkpoints' folder too
        # A fit that starts past step 0 was resumed: its points after the checkpoint are replayed, and
        # replace the interrupted run's. A new run reusing a folder's name starts that run over.
        step = trainer.state.global_step
        resumed = step > 0
        existing = os.path.isdir(os.path.join(logs_dir, name))
        purge = step + 1 if resumed else (0 if existing else None)
        saved_step, saved_points = self._restored_points
        self._replay = (step, saved_points if saved_step == step else {}) if resumed else None
        self._at_step = (-1, {})
        project = self.project_name or os.path.basename(os.path.abspath(acc.project_dir or trainer.project_dir))
        self._run = run = RunInfo(logs_dir, name, project or "fittrain", purge)
        self.trackers = open_trackers(self.log_with, acc.is_main_process,
                                      lambda cls, kwargs: cls.for_run(run, **kwargs), self.init_kwargs)
        live = [tracker for tracker in self.trackers if not isinstance(tracker, NoOpTracker)]
        self._writers = [getattr(tracker, "log_scalars", None) or tracker.log for tracker in live]
        if live and not resumed:
            hparams = run_hparams(trainer, self.hparams)
            for tracker in live:
                tracker.store_init_configuration(hparams)
        # What a resumed run restored was written by the interrupted run: not again.
        self._written = dict(trainer.state.raw_metrics)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """This run's tracker called `name` (with `unwrap`, its underlying object), as
        `Accelerator.get_tracker`; a NoOpTracker on other processes.

        Raises:
            ValueError: when no tracker of this run has that name (or the run has not started).
        """
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"Logger.get_tracker({name!r}): this run has no tracker of that name. Its trackers: "
                         f"{[t.name for t in self.trackers]} (none before the first epoch starts).")

    def _log_training(self, trainer: "Trainer", step: int) -> None:
        now = time.perf_counter()
        metrics = trainer.state.metrics  # the device syncs happen here, at logging points only
        raw = trainer.state.raw_metrics
        # Validation metrics were written when validation ended (and a resumed run's restored ones by the run
        # before): repeating them every n steps would add stale points.
        old, hidden = self._written, trainer.logged.hidden
        scalars = {name: value for name, value in metrics.items()
                   if (name not in old or raw[name] is not old[name]) and name not in hidden}
        scalars.update(self._learning_rates(trainer))
        scalars.update(self._throughput(trainer, step, now))
        self._write(scalars, step)
        shown = {"loss": f"{scalars['train_loss']:.4g}"} if "train_loss" in scalars else {}
        lr = scalars.get("lr", scalars.get("lr/opt_0"))
        if lr is not None:
            shown["lr"] = f"{lr:.3g}"
        self._progress.show(shown, refresh=False)
        self._last_step = step

    @staticmethod
    def _learning_rates(trainer: "Trainer") -> dict[str, float]:
        optimizers = getattr(trainer, "optimizers", None) or [trainer.optimizer]
        if len(optimizers) == 1:
            return _group_rates(optimizers[0], "lr")
        rates: dict[str, float] = {}
        for i, optimizer in enumerate(optimizers):
            rates.update(_group_rates(optimizer, f"lr/opt_{i}"))
        return rates

    def _throughput(self, trainer: "Trainer", step: int, now: float) -> dict[str, float]:
        started, first_step = self._mark
        elapsed = now - started
        rates: dict[str, float] = {}
        if elapsed > 0:
            rates["throughput/steps_per_sec"] = (step - first_step) / elapsed
            # total_batch_size: samples per loader step summed over processes, so this is the global rate.
            batch = getattr(trainer.train_loader, "total_batch_size", None)
            if batch:
                rates["throughput/samples_per_sec"] = self._batches * batch / elapsed
        self._restart_clock(step)
        return rates

    def _restart_clock(self, step: int) -> None:
        self._mark = (time.perf_counter(), step)
        self._batches = 0

    def _write(self, scalars: dict[str, float], step: int, flush: bool = False) -> None:
        if self._replay is not None:
            self._settle_replay(step)
        at, points = self._at_step
        if at != step:
            self._at_step = (step, points := {})
        points.update(scalars)
        for write in self._writers:
            write(scalars, step)
        if flush:
            for tracker in self.trackers:
                getattr(tracker, "flush", _nothing)()

    def _settle_replay(self, step: int) -> None:
        """At a resumed run's first write: when it writes the checkpoint's step again (an epoch-end
        validation that ran after the save), the points at that step are replaced: purged, then
        the ones written before the save are rewritten from the checkpoint."""
        replay_step, points = self._replay
        self._replay = None
        if step != replay_step:
            return
        for tracker in self.trackers:
            purge = getattr(tracker, "purge", None)
            if purge is not None and not isinstance(tracker, NoOpTracker):
                purge(step)
        if points:
            self._write(points, step)

    def _close(self) -> None:
        self._progress.close()
        self._active, self._trainer = False, None
        trackers, self.trackers, self._writers = self.trackers, [], []
        for tracker in trackers:
            if not isinstance(tracker, NoOpTracker):
                tracker.finish()

    def __repr__(self) -> str:
        names = [getattr(spec, "name", "?") for spec in self.log_with]
        return (f"Logger(log_dir={self.log_dir!r}, every_n_steps={self.every_n_steps}, log_with={names}, "
                f"run_name={self.run_name!r}, progress_bar={self.progress_bar})")


def _group_rates(optimizer: Any, prefix: str) -> dict[str, float]:
    """`prefix`: the first parameter group's learning rate; `{prefix}/group_{i}`: each group's, when several."""
    groups = optimizer.param_groups
    rates = {prefix: float(groups[0]["lr"])}
    if len(groups) > 1:
        rates.update({f"{prefix}/group_{i}": float(group["lr"]) for i, group in enumerate(groups)})
    return rates


def _nothing() -> None:
    """A flush for trackers that have none."""
