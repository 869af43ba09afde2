"""When the LR scheduler steps: what `configure_optimizers` returned, read once, and the steps.

`fittrain.trainer.configure.parse_optimizers(module)` reads what `configure_optimizers` returned
into the optimizer and a `SchedulerConfig` (Lightning's lr_scheduler dict, checked).
`make_schedule(config, ...)` prepares the scheduler and returns a `Schedule`, whose three methods
the Trainer calls at fixed points of its loop; each kind acts in one of them and does nothing in
the others, and with no scheduler the base `Schedule` does nothing at all, so the loop never
branches on it:

    after_optimizer_step(global_step)   right after each optimizer step
    after_validation(metrics, ...)      right after each validation during fit
    after_epoch(epoch)                  at each epoch end, after that epoch's validation

What steps when (Lightning's keys and meanings, except where noted; counted in optimizer steps
and epochs):

- interval "step" (the default, unlike Lightning's "epoch"): after every `frequency`-th optimizer
  step (`global_step % frequency == 0`); an fp16 step skipped for overflow does not advance it.
- interval "epoch": at the end of every `frequency`-th epoch (`(epoch + 1) % frequency == 0`).
- a scheduler with a `monitor` (ReduceLROnPlateau, or `reduce_on_plateau=True`) steps on the
  monitored metric right after a validation: with interval "epoch" (its default, as in Lightning)
  after the validation ending every `frequency`-th epoch; with interval "step" after the
  mid-epoch validations (`val_every_n_steps`) that fall on every `frequency`-th optimizer step.
  Unlike Lightning it never steps on an old value between validations, and a configuration under
  which it could never step is refused when fit starts.

Every step happens before `on_train_batch_end` and `on_train_epoch_end`, where checkpoints are
saved, so a checkpoint holds the scheduler after its step and a resume continues exactly. The
counters are the Trainer's own `global_step` and `epoch`, which checkpoints restore.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping

from fittrain.trainer.configure import LR_SCHEDULER_DICT, SchedulerConfig
from fittrain.trainer.monitor import Monitor

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator
    from fittrain.step.optim import AcceleratedScheduler

# ----------------------------------------------------------------- stepping
class Schedule:
    """Steps the LR scheduler at the loop's fixed points; this base has none and does nothing.

    Attributes:
        scheduler: The prepared scheduler (`trainer.scheduler`), or None.
    """

    scheduler: "AcceleratedScheduler | None" = None
    #: Whether `after_optimizer_step` does anything: the automatic step calls it only then.
    every_step = False

    def after_optimizer_step(self, global_step: int) -> None:
        """Called right after each optimizer step, with the steps taken so far (from 1)."""

    def after_validation(self, metrics: Mapping[str, Any], *, epoch: int | None = None,
                         step: int | None = None) -> None:
        """Called right after each validation of fit: `epoch` given at an epoch end, `step` mid-epoch."""

    def after_epoch(self, epoch: int) -> None:
        """Called at the end of each epoch (from 0), after that epoch's validation."""


class StepSchedule(Schedule):
    """Interval "step": steps after every `frequency`-th optimizer step."""

    every_step = True

    def __init__(self, scheduler: "AcceleratedScheduler", frequency: int) -> None:
        self.scheduler, self.frequency = scheduler, frequency

    def after_optimizer_step(self, global_step: int) -> None:
        if global_step % self.frequency == 0:
            self.scheduler.step()  # the prepared one: it does not advance after an fp16-skipped step


class EpochSchedule(Schedule):
    """Interval "epoch": steps at the end of every `frequency`-th epoch."""

    def __init__(self, scheduler: "AcceleratedScheduler", frequency: int) -> None:
        self.scheduler, self.frequency = scheduler, frequency

    def after_epoch(self, epoch: int) -> None:
        if (epoch + 1) % self.frequency == 0:
            _step_unwrapped(self.scheduler)  # an epoch end is not an optimizer step


class MetricSchedule(Schedule):
    """A scheduler with a monitor (ReduceLROnPlateau): steps on the metric right after a validation.

    Args:
        scheduler: The prepared scheduler.
        config: Its interval, frequency, monitor and strictness.
        accelerator: Broadcasts the main process's value, so every process steps alike even on a
            metric that differs between processes (such as train_loss).
    """

    def __init__(self, scheduler: "AcceleratedScheduler", config: SchedulerConfig, accelerator: "Accelerator") -> None:
        self.scheduler, self.config, self.accelerator = scheduler, config, accelerator
        # Reads the metric; the scheduler keeps its own mode and best (ReduceLROnPlateau's), shown here too.
        mode = getattr(config.scheduler, "mode", "min")
        self.monitor = Monitor(config.monitor, mode if mode in ("min", "max") else "min", owner="lr_scheduler")
        self._warned = False

    def after_validation(self, metrics: Mapping[str, Any], *, epoch: int | None = None,
                         step: int | None = None) -> None:
        config = self.config
        if config.interval == "epoch":
            due = epoch is not None and (epoch + 1) % config.frequency == 0
        else:
            due = step is not None and step % config.frequency == 0
        if not due:
            return
        value = self.monitor.read(metrics)  # a float, or a tensor logged in training_step (one device sync)
        if self.accelerator.num_processes > 1:
            value = self.accelerator.broadcast(value)  # once per validation, never per step
        if value is None:
            self._missing(metrics)
            return
        _step_unwrapped(self.scheduler, value)

    def _missing(self, metrics: Mapping[str, Any]) -> None:
        config, kind = self.config, type(self.scheduler.scheduler).__name__
        message = self.monitor.missing(metrics, f"`monitor` in {LR_SCHEDULER_DICT}",
                                       f" after validation, so {kind} cannot step")
        if config.strict:
            raise ValueError(message)
        if not self._warned:  # strict=False: Lightning's choice to skip the step with a warning
            self._warned = True
            warnings.warn(message + " (strict=False: the scheduler does not step; warned once.)", stacklevel=3)


def _step_unwrapped(scheduler: "AcceleratedScheduler", *metric: float) -> None:
    """Steps the wrapped scheduler at an epoch end or after a validation, whatever the last batch did.

    In a resumed process that step may come before the process's first optimizer step (a resume
    at an epoch end), where torch warns that the scheduler steps before the optimizer: here that
    order is the intended one, so the warning is silenced (once per epoch, not per step).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.scheduler.step(*metric)


def make_schedule(config: SchedulerConfig | None, accelerator: "Accelerator", validates: bool,
                  val_every_n_epochs: int | None, val_every_n_steps: int | float | None) -> Schedule:
    """Prepares the configured scheduler and returns the `Schedule` that steps it.

    Args:
        config: What `parse_optimizers` returned (None: no scheduler).
        accelerator: Prepares the scheduler, so its state travels in checkpoints.
        validates: Whether fit validates (a val_loader, and limit_val_batches is not 0).
        val_every_n_epochs, val_every_n_steps: The Trainer's validation intervals.

    Raises:
        ValueError: for a scheduler with a monitor that no validation of this fit would ever step.
    """
    if config is None:
        return Schedule()
    if config.monitor is not None:
        _check_validation(config, validates, val_every_n_epochs, val_every_n_steps)
    prepared = accelerator.prepare(config.scheduler)
    prepared.steps_per_call = 1  # the Trainer counts optimizer steps, not per-process batches
    if config.monitor is not None:
        return MetricSchedule(prepared, config, accelerator)
    kind = StepSchedule if config.interval == "step" else EpochSchedule
    return kind(prepared, config.frequency)


def _check_validation(config: SchedulerConfig, validates: bool, every_n_epochs: int | None,
                      every_n_steps: int | float | None) -> None:
    kind, monitor = type(config.scheduler).__name__, config.monitor
    head = f"{kind} (monitor={monitor!r}, interval={config.interval!r}) steps right after a validation"
    if not validates:
        raise ValueError(f"{head}, but this fit never validates (no val_loader, or limit_val_batches=0), so it would "
                         "never step. Pass a val_loader to fit, or return a scheduler that needs no metric.")
    if config.interval == "epoch" and every_n_steps is not None:
        frequency = every_n_steps if isinstance(every_n_steps, int) else "n"
        raise ValueError(
            f"{head} at an epoch end, but Trainer(val_every_n_steps={every_n_steps}) validates only in the middle "
            f"of epochs, so it would never step. Use {{'interval': 'step', 'frequency': {frequency}}} in the "
            "lr_scheduler dict to step after those validations, or validate at epoch ends (val_every_n_epochs).")
    if config.interval == "step" and every_n_steps is None:
        raise ValueError(
            f"{head} in the middle of an epoch, but Trainer(val_every_n_epochs={every_n_epochs}) validates only at "
            "epoch ends, so it would never step. Use 'interval': 'epoch' in the lr_scheduler dict, or "
            "Trainer(val_every_n_steps=n) to validate every n optimizer steps.")
