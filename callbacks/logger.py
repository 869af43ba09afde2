"""Logger: TensorBoard scalars and a tqdm progress bar, written by the main process only."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from fittrain.events import Callback
from fittrain.trainer_parts import length_of

if TYPE_CHECKING:
    from fittrain.trainer import Trainer


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`Logger({name}=...)` must be True or False. Received: {name}={value!r}.")
    return value


class Logger(Callback):
    """Writes metrics, learning rate and throughput to TensorBoard and shows a progress bar per epoch.

    Every `every_n_steps` optimizer steps it writes every metric of `trainer.state.metrics`
    (the tag is the metric's name, the step is `global_step`), `lr` (and `lr/group_{i}` when the
    optimizer has several parameter groups) and `throughput/steps_per_sec` and
    `throughput/samples_per_sec`, measured since the previous logging point. The training metrics
    are also written before each validation and at the end of the fit, so short runs are logged
    too. Validation metrics are written once, when validation ends, at the current `global_step`
    (a validation in the middle of an epoch, with `Trainer(val_every_n_steps=...)`, is written
    at its step like one at an epoch end). For a stream, which has no length, the bar counts
    batches without a total.

    Per batch it only advances the bar and compares the step with `every_n_steps`: metrics are
    read (a device sync each) at logging points only, and the bar redraws at most ten times a
    second. On other processes than the main one it does nothing.

    Args:
        log_dir: The TensorBoard folder. Default: the Accelerator's `logging_dir`, which is
            `{project_dir}/logs`.
        every_n_steps: Optimizer steps between logging points.
        tensorboard: Write TensorBoard event files.
        progress_bar: Show a tqdm bar with loss, lr and it/s.

    Raises:
        ValueError: for `every_n_steps` that is not a positive integer, or a flag that is not a bool.

    Example:
        >>> Trainer(callbacks=[Logger(every_n_steps=50)], project_dir="runs/a").fit(module, loader)
        >>> # then: tensorboard --logdir runs/a/logs
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, every_n_steps: int = 10, tensorboard: bool = True,
                 progress_bar: bool = True) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`Logger(every_n_steps=...)` must be a positive integer. "
                             f"Received: every_n_steps={every_n_steps!r}.")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"`Logger(log_dir=...)` must be a folder path or None. Received: log_dir={log_dir!r}.")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.every_n_steps = every_n_steps
        self.tensorboard = _check_flag("tensorboard", tensorboard)
        self.progress_bar = _check_flag("progress_bar", progress_bar)
        # Until on_fit_start decides otherwise, the logger is silent: a disabled bar, no writer.
        self._active = False
        self._show_bar = False
        self._writer: Any = None
        self._bar = tqdm(disable=True)
        self._postfix: dict[str, str] = {}
        self._before_validation: dict[str, Any] = {}
        self._validation_values: dict[str, Any] = {}
        self._last_step = 0
        self._mark = (0.0, 0)  # (perf_counter time, global_step) at the last logging point
        self._batches = 0  # batches since that point

    # ----------------------------------------------------------------- lifecycle
    def on_fit_start(self, trainer: "Trainer") -> None:
        """Opens the TensorBoard writer on the main process."""
        is_main = trainer.accelerator.is_main_process
        self._active = is_main and (self.tensorboard or self.progress_bar)
        self._show_bar = is_main and self.progress_bar
        self._writer = self._open_writer(trainer) if is_main and self.tensorboard else None
        self._postfix, self._validation_values = {}, {}

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Starts this epoch's progress bar and the throughput clock."""
        self._bar.close()
        loader = trainer.train_loader
        # A resumed epoch continues after the batches its checkpoint had consumed.
        done = getattr(getattr(loader, "position", None), "batches_consumed", 0)
        # A stream has no length: the bar then counts batches without a total.
        self._bar = tqdm(total=length_of(loader), initial=done, desc=f"Epoch {trainer.state.epoch}", mininterval=0.1,
                         dynamic_ncols=True, disable=not self._show_bar)
        self._last_step = trainer.state.global_step
        self._restart_clock(trainer.state.global_step)

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """Advances the bar; at every `every_n_steps`-th optimizer step, logs the training metrics."""
        self._bar.update()
        self._batches += 1
        step = trainer.state.global_step
        # Accumulating batches repeat a step; it is logged once.
        if step % self.every_n_steps or step == self._last_step or not self._active:
            return
        self._log_training(trainer, step)

    def on_validation_start(self, trainer: "Trainer") -> None:
        """Logs the training metrics reached so far, then remembers which metric values exist."""
        if not self._active:
            return
        if trainer.state.global_step != self._last_step:
            self._log_training(trainer, trainer.state.global_step)
        trainer.state.raw_metrics.as_floats()  # converts pending tensors in place, so identities stay stable
        self._before_validation = dict(trainer.state.raw_metrics)

    def on_validation_end(self, trainer: "Trainer") -> None:
        """Writes the metrics this validation produced and shows them on the bar."""
        if not self._active:
            return
        # Validation stores new float objects; anything else in the metrics is the same object as before.
        raw = trainer.state.raw_metrics
        fresh = {name: value for name, value in raw.items() if self._before_validation.get(name) is not value}
        self._validation_values = fresh
        scalars = {name: float(value) for name, value in fresh.items()}
        self._write(scalars, trainer.state.global_step, flush=True)  # a live TensorBoard then sees each validation
        self._postfix.update({name: f"{value:.4g}" for name, value in scalars.items()})
        self._bar.set_postfix(self._postfix)

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """Closes this epoch's bar."""
        self._bar.close()

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Logs the last training metrics, then closes the bar and the writer."""
        if self._active and trainer.state.global_step != self._last_step:
            self._log_training(trainer, trainer.state.global_step)
        self._close()

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Closes the bar and the writer, keeping what was written so far."""
        self._close()

    # ----------------------------------------------------------------- helpers
    def _open_writer(self, trainer: "Trainer") -> "_ScalarWriter":
        folder = self.log_dir or trainer.accelerator.logging_dir or os.path.join(trainer.project_dir, "logs")
        return _ScalarWriter(folder)

    def _log_training(self, trainer: "Trainer", step: int) -> None:
        now = time.perf_counter()
        metrics = trainer.state.metrics  # the device syncs happen here, at logging points only
        raw = trainer.state.raw_metrics
        # Validation metrics were written when validation ended; repeating them every n steps adds stale points.
        stale = self._validation_values
        scalars = {name: value for name, value in metrics.items() if name not in stale or raw[name] is not stale[name]}
        scalars.update(self._learning_rates(trainer))
        scalars.update(self._throughput(trainer, step, now))
        self._write(scalars, step)
        if "train_loss" in scalars:
            self._postfix["loss"] = f"{scalars['train_loss']:.4g}"
        self._postfix["lr"] = f"{scalars['lr']:.3g}"
        self._bar.set_postfix(self._postfix, refresh=False)
        self._last_step = step

    @staticmethod
    def _learning_rates(trainer: "Trainer") -> dict[str, float]:
        groups = trainer.optimizer.param_groups
        rates = {"lr": float(groups[0]["lr"])}
        if len(groups) > 1:
            rates.update({f"lr/group_{i}": float(group["lr"]) for i, group in enumerate(groups)})
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
        if self._writer is not None:
            self._writer.write(scalars, step, flush)

    def _close(self) -> None:
        self._bar.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return (f"Logger(log_dir={self.log_dir!r}, every_n_steps={self.every_n_steps}, "
                f"tensorboard={self.tensorboard}, progress_bar={self.progress_bar})")


class _ScalarWriter:
    """A TensorBoard event file that takes all the scalars of one logging point as one event.

    torch's `SummaryWriter.add_scalar` builds and queues one event per scalar, through several
    layers; a logging point writes five or more, and on a small CPU that cost about 1 ms. One
    event holding every value, written with tensorboard's own `EventFileWriter`, costs a quarter
    of that and reads back the same (each value is a scalar under its tag).

    Args:
        folder: The log folder; created if missing.
    """

    def __init__(self, folder: str) -> None:
        # Imported here: tensorboard takes a noticeable time to import, which tensorboard=False should not pay.
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._file = EventFileWriter(folder)

    def write(self, scalars: dict[str, float], step: int, flush: bool = False) -> None:
        """Appends one event with every scalar at `step`; `flush` pushes it to disk now."""
        values = [self._summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self._file.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
        if flush:
            self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        self._file.close()
