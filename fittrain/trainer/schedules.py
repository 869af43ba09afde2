"""When the LR scheduler steps: what `configure_optimizers` returned, read once, and the steps.

`parse_optimizers(module)` checks what `TrainModule.configure_optimizers` returned and reads it
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

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from fittrain.trainer.parts import LazyMetrics, describe

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator
    from fittrain.trainer.module import TrainModule
    from fittrain.step.optim import AcceleratedScheduler

_TOP_KEYS = ("optimizer", "lr_scheduler", "monitor")
_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau")
_FORMS = ("an optimizer, an (optimizer, scheduler) pair, or {'optimizer': optimizer, 'lr_scheduler': scheduler "
          "or {'scheduler': scheduler, 'interval': 'step' or 'epoch', 'frequency': n, 'monitor': metric}}")
_WHERE = "the lr_scheduler dict configure_optimizers returned"
_Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """How the LR scheduler steps: Lightning's lr_scheduler dict, checked.

    Attributes:
        scheduler: The LR scheduler, built on the returned optimizer.
        interval: "step" (counts optimizer steps) or "epoch".
        frequency: The scheduler steps every `frequency` intervals.
        monitor: The metric a scheduler driven by a metric steps on; None for the others.
        strict: With a monitor: a missing metric is an error (True) or a warning and no step (False).
        name: Lightning's display name for the learning rate (kept for loggers).
    """

    scheduler: Any
    interval: str = "step"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None


# ----------------------------------------------------------------- reading configure_optimizers
def parse_optimizers(module: "TrainModule") -> tuple[torch.optim.Optimizer, SchedulerConfig | None]:
    """Interprets and checks `configure_optimizers()`.

    Returns:
        (optimizer, the scheduler's config or None).

    Raises:
        TypeError, ValueError: naming what was returned, for anything but one optimizer over the
            module's own parameters and at most one LR scheduler on that optimizer, configured
            with known keys and values.
    """
    result = module.configure_optimizers()
    optimizer, spec, monitor = _unpack(result)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers must return {_FORMS}. Received: {describe(result)}.")
    config = _scheduler_config(spec, monitor)
    if config is not None:
        _check_scheduler(config.scheduler, optimizer)
    _check_owned(optimizer, module)
    return optimizer, config


def _one(value: Any) -> Any:
    """Lightning's lists of one, as in `return [opt], [sched]`, stand for the item itself."""
    if isinstance(value, (tuple, list)) and len(value) <= 1:
        return value[0] if value else None
    return value


def _unpack(result: Any) -> tuple[Any, Any, Any]:
    """(optimizer, scheduler or its dict, top-level monitor) from any accepted form."""
    if isinstance(result, (tuple, list)) and len(result) == 1 and isinstance(result[0], dict):
        result = result[0]  # Lightning's list of one optimizer dict
    if isinstance(result, dict):
        _check_keys(result, _TOP_KEYS, "the dict configure_optimizers returned")
        return result.get("optimizer"), result.get("lr_scheduler"), result.get("monitor")
    if not isinstance(result, (tuple, list)):
        return result, None, None
    items = [_one(item) for item in result]
    nested = [x for item in items for x in (item if isinstance(item, (tuple, list)) else [item])]
    nested = [x.get("optimizer") if isinstance(x, dict) else x for x in nested]  # Lightning's list of dicts
    optimizers = {id(x) for x in nested if isinstance(x, torch.optim.Optimizer)}
    if len(optimizers) > 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers: {describe(result)}. Automatic optimization "
            "steps one optimizer. For several, stepped in turn (a GAN), set `self.automatic_optimization = False` in "
            "the module's __init__ and step them in training_step with self.optimizers() and self.manual_backward("
            "loss) (docs: 'Manual optimization'); or use one optimizer with a parameter group per part, e.g. "
            "torch.optim.Adam([{'params': self.a.parameters()}, {'params': self.b.parameters(), 'lr': 1e-4}]).")
    if len(items) > 2:
        raise TypeError(f"configure_optimizers must return {_FORMS}. Received {len(items)} items: {describe(result)}.")
    return items[0], (items[1] if len(items) == 2 else None), None


def _check_keys(spec: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in spec:
        if key not in allowed:
            raise ValueError(f"Unknown key {describe(key)} in {where}. Received: {describe(spec)}. "
                             f"Allowed keys: {', '.join(allowed)}. Remove it or correct its spelling.")


def _scheduler_config(spec: Any, top_monitor: Any) -> SchedulerConfig | None:
    """The checked config of a bare scheduler or of Lightning's dict form (None: no scheduler)."""
    if spec is None:
        if top_monitor is not None:
            raise ValueError(f"'monitor' in the dict configure_optimizers returned has no scheduler to drive. "
                             f"Received: monitor={describe(top_monitor)} and no 'lr_scheduler'. Add 'lr_scheduler': "
                             "ReduceLROnPlateau(optimizer), or remove 'monitor'.")
        return None
    if not isinstance(spec, dict):
        spec = {"scheduler": spec}
    _check_keys(spec, _SCHEDULER_KEYS, _WHERE)
    if "scheduler" not in spec:
        raise ValueError("The lr_scheduler dict configure_optimizers returned has no 'scheduler' key. "
                         f"Received: {describe(spec)}. "
                         "Return {'scheduler': scheduler, 'interval': 'step'}.")
    scheduler = spec["scheduler"]
    by_metric = spec.get("reduce_on_plateau", isinstance(scheduler, _Plateau))
    _require(isinstance(by_metric, bool), "reduce_on_plateau", by_metric, "True or False")
    interval, frequency = spec.get("interval", "epoch" if by_metric else "step"), spec.get("frequency", 1)
    _require(interval in ("step", "epoch"), "interval", interval, "'step' or 'epoch'")
    _require(type(frequency) is int and frequency >= 1, "frequency", frequency, "a positive integer")
    strict, name = spec.get("strict", True), spec.get("name")
    _require(isinstance(strict, bool), "strict", strict, "True or False")
    _require(name is None or isinstance(name, str), "name", name, "a str or None")
    monitor = spec.get("monitor", top_monitor)
    _require(monitor is None or (isinstance(monitor, str) and bool(monitor)), "monitor", monitor, "a metric name")
    _check_metric_use(scheduler, by_metric, monitor, _WHERE if "monitor" in spec or top_monitor is None else
                      "the dict configure_optimizers returned")
    return SchedulerConfig(scheduler, interval, frequency, monitor if by_metric else None, strict, name)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"`{key}` in {_WHERE} must be {allowed}. Received: {key}={describe(value)}.")


def _check_metric_use(scheduler: Any, by_metric: bool, monitor: str | None, where: str) -> None:
    """A scheduler driven by a metric needs a monitor (as in Lightning); the others take none."""
    kind = type(scheduler).__name__
    if isinstance(scheduler, _Plateau) and not by_metric:
        raise ValueError(f"{kind} needs a metric at each step, but {_WHERE} says reduce_on_plateau=False. "
                         "Remove 'reduce_on_plateau' (it is True for ReduceLROnPlateau).")
    if by_metric and monitor is None:
        raise ValueError(
            f"{kind} returned by configure_optimizers steps on a metric, but no 'monitor' in the lr_scheduler "
            "dict names it. Received: monitor=None. Return {'optimizer': optimizer, 'lr_scheduler': {'scheduler': "
            "scheduler, 'monitor': 'val_loss'}}, with a metric that validation produces.")
    if not by_metric and monitor is not None:
        raise ValueError(
            f"'monitor' in {where} was given for {kind}, which steps without a metric: the monitor would be ignored. "
            f"Received: monitor={describe(monitor)}. Remove 'monitor', or use a scheduler driven by a metric such "
            "as ReduceLROnPlateau (or set 'reduce_on_plateau': True for your own one, whose step(metric) takes it).")


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"The scheduler returned by configure_optimizers must be an LR scheduler (a torch.optim."
                        f"lr_scheduler.LRScheduler such as StepLR). Received: {describe(scheduler)}.")
    if scheduler.optimizer is not optimizer:
        raise ValueError(f"The scheduler returned by configure_optimizers ({type(scheduler).__name__}) was built on "
                         "another optimizer than the one returned with it. Build it on that optimizer.")


def _check_owned(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """Refuses parameters that are not the module's: the Trainer would not move, wrap or save them."""
    owned = {id(p) for p in module.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"configure_optimizers returned a {type(optimizer).__name__} over {len(foreign)} parameter(s) that are "
            f"not parameters of {type(module).__name__} (shapes {shapes}). Training would not change the module, "
            "and checkpoints would not hold them. Build the optimizer from self.parameters(), and make any other "
            "trained tensor a submodule or nn.Parameter of the module.")


# ----------------------------------------------------------------- stepping
class Schedule:
    """Steps the LR scheduler at the loop's fixed points; this base has none and does nothing.

    Attributes:
        scheduler: The prepared scheduler (`trainer.scheduler`), or None.
    """

    scheduler: "AcceleratedScheduler | None" = None

    def after_optimizer_step(self, global_step: int) -> None:
        """Called right after each optimizer step, with the steps taken so far (from 1)."""

    def after_validation(self, metrics: Mapping[str, Any], *, epoch: int | None = None,
                         step: int | None = None) -> None:
        """Called right after each validation of fit: `epoch` given at an epoch end, `step` mid-epoch."""

    def after_epoch(self, epoch: int) -> None:
        """Called at the end of each epoch (from 0), after that epoch's validation."""


class StepSchedule(Schedule):
    """Interval "step": steps after every `frequency`-th optimizer step."""

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
        value = metrics.get(config.monitor)
        if value is not None:  # a float, or a tensor logged in training_step (one device sync)
            value = LazyMetrics({config.monitor: value}).as_floats()[config.monitor]
        if self.accelerator.num_processes > 1:
            value = self.accelerator.broadcast(value)  # once per validation, never per step
        if value is None:
            self._missing(metrics)
            return
        _step_unwrapped(self.scheduler, value)

    def _missing(self, metrics: Mapping[str, Any]) -> None:
        config, kind = self.config, type(self.scheduler.scheduler).__name__
        message = (f"`monitor` in {_WHERE} names a metric that does not exist after validation, so {kind} cannot "
                   f"step. Received: monitor={config.monitor!r}. Metrics that exist: {sorted(metrics)}. Pass one of "
                   f"them, or return/log {config.monitor!r} from validation_step.")
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
                  val_every_n_epochs: int | None, val_every_n_steps: int | None) -> Schedule:
    """Prepares the configured scheduler and returns the `Schedule` that steps it.

    Args:
        config: What `parse_optimizers` returned (None: no scheduler).
        accelerator: Prepares the scheduler, so its state travels in checkpoints.
        validates: Whether fit received a val_loader.
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
                      every_n_steps: int | None) -> None:
    kind, monitor = type(config.scheduler).__name__, config.monitor
    head = f"{kind} (monitor={monitor!r}, interval={config.interval!r}) steps right after a validation"
    if not validates:
        raise ValueError(f"{head}, but fit received no val_loader, so it would never step. Pass a val_loader to "
                         "fit, or return a scheduler that needs no metric.")
    if config.interval == "epoch" and every_n_epochs is None:
        raise ValueError(
            f"{head} at an epoch end, but Trainer(val_every_n_steps={every_n_steps}) validates only in the middle "
            f"of epochs, so it would never step. Use {{'interval': 'step', 'frequency': {every_n_steps}}} in the "
            "lr_scheduler dict to step after those validations, or validate at epoch ends (val_every_n_epochs).")
    if config.interval == "step" and every_n_steps is None:
        raise ValueError(
            f"{head} in the middle of an epoch, but Trainer(val_every_n_epochs={every_n_epochs}) validates only at "
            "epoch ends, so it would never step. Use 'interval': 'epoch' in the lr_scheduler dict, or "
            "Trainer(val_every_n_steps=n) to validate every n optimizer steps.")
