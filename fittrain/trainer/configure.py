"""Reading `configure_optimizers`: the one parser of what a TrainModule returns, for both optimization modes.

Automatic optimization (`parse_optimizers`): one optimizer over the module's parameters and at
most one LR scheduler on it, which the loop steps (`fittrain.trainer.schedules` says when):

    optimizer                                   one optimizer
    (opt, sched), [opt], [sched]                fittrain's pair; Lightning's lists of one
    {"optimizer": opt, "lr_scheduler": sched}   sched may be Lightning's dict: {"scheduler": s,
                                                "interval": "step" or "epoch", "frequency": n,
                                                "monitor": "val_loss", "strict": ..., "name": ...}

Manual optimization (`parse_manual_optimizers`, with `automatic_optimization = False`): any of
Lightning's forms, with several optimizers and schedulers:

    optimizer                                   one optimizer
    [opt_g, opt_d]                              a list (or tuple) of optimizers
    ([opt_g, opt_d], [sched_g, sched_d])        optimizers and schedulers, in two lists
    (opt, sched)                                fittrain's pair
    {"optimizer": opt, "lr_scheduler": sched}   one dict, or a list/tuple of such dicts

In manual optimization a scheduler may be given as Lightning's dict `{"scheduler": s}` (with an
optional "name"). The keys that tell the loop when to step it ("interval", "frequency", "monitor",
"strict", "reduce_on_plateau") are refused there: the Trainer steps no scheduler, the training_step
calls `sch.step()` itself (Lightning ignores those keys with a warning).

Every optimizer must train parameters of the module (`_check_owned`), and in manual optimization
no parameter may belong to two of them: both would step it, each with its own state.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fittrain.trainer.parts import describe

if TYPE_CHECKING:
    from fittrain.trainer.module import TrainModule

_TOP_KEYS = ("optimizer", "lr_scheduler", "monitor")
_SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau")
_FORMS = ("an optimizer, an (optimizer, scheduler) pair, or {'optimizer': optimizer, 'lr_scheduler': scheduler "
          "or {'scheduler': scheduler, 'interval': 'step' or 'epoch', 'frequency': n, 'monitor': metric}}")
#: How messages name Lightning's lr_scheduler dict (also the plateau schedule's, in schedules.py).
LR_SCHEDULER_DICT = "the lr_scheduler dict configure_optimizers returned"
_WHERE = LR_SCHEDULER_DICT
_Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
_Optimizer = torch.optim.Optimizer
_Scheduler = torch.optim.lr_scheduler.LRScheduler
_MANUAL_FORMS = ("an optimizer, a list of optimizers, ([optimizers], [schedulers]), or a list of {'optimizer': ..., "
          "'lr_scheduler': ...} dicts")
_LOOP_KEYS = ("interval", "frequency", "monitor", "strict", "reduce_on_plateau")


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


# ----------------------------------------------------------------- manual optimization


def check_automatic_optimization(module: "TrainModule") -> bool:
    """The module's `automatic_optimization`, checked to be a bool.

    Raises:
        TypeError: for any other value.
    """
    value = module.automatic_optimization
    if not isinstance(value, bool):
        raise TypeError(f"`{type(module).__name__}.automatic_optimization` must be True or False. Received: "
                        f"automatic_optimization={describe(value)}. Set self.automatic_optimization = False in "
                        "__init__ to step the optimizers in training_step.")
    return value


def parse_manual_optimizers(module: "TrainModule") -> tuple[list[_Optimizer], list[Any]]:
    """Interprets and checks `configure_optimizers()` for manual optimization.

    Returns:
        (the optimizers, the LR schedulers), each in the order returned.

    Raises:
        TypeError, ValueError: naming what was returned, for anything but optimizers over the
            module's own disjoint parameters and LR schedulers built on them.
    """
    result = module.configure_optimizers()
    optimizers, schedulers = _split(result)
    if not optimizers or not all(isinstance(o, _Optimizer) for o in optimizers):
        raise TypeError(f"configure_optimizers must return {_MANUAL_FORMS}. Received: {describe(result)}.")
    schedulers = [_scheduler(spec) for spec in schedulers]
    for scheduler in schedulers:
        if not isinstance(scheduler, _Scheduler):
            raise TypeError("Each scheduler returned by configure_optimizers must be an LR scheduler (a torch.optim."
                            f"lr_scheduler.LRScheduler such as StepLR). Received: {describe(scheduler)} in "
                            f"{describe(result)}.")
        if not any(scheduler.optimizer is o for o in optimizers):
            raise ValueError(f"The scheduler {type(scheduler).__name__} returned by configure_optimizers was built on "
                             "an optimizer that configure_optimizers did not return. Build it on one of the returned "
                             "optimizers, and return that optimizer too.")
    for optimizer in optimizers:
        _check_owned(optimizer, module)
    _check_disjoint(optimizers, module)
    return optimizers, schedulers


def _split(result: Any) -> tuple[list[Any], list[Any]]:
    """(optimizers, scheduler specs) from any accepted form; types are checked by the caller."""
    if isinstance(result, dict):
        return _from_dicts([result])
    if not isinstance(result, (tuple, list)):
        return [result], []
    if result and all(isinstance(item, dict) for item in result):
        return _from_dicts(list(result))
    if len(result) == 2 and all(isinstance(item, (tuple, list)) for item in result):
        return list(result[0]), list(result[1])  # Lightning's ([optimizers], [schedulers])
    if len(result) == 2 and isinstance(result[0], _Optimizer) and isinstance(result[1], (_Scheduler, dict)):
        return [result[0]], [result[1]]  # fittrain's (optimizer, scheduler) pair
    return list(result), []


def _from_dicts(specs: list[dict]) -> tuple[list[Any], list[Any]]:
    optimizers, schedulers = [], []
    for spec in specs:
        unknown = [key for key in spec if key not in ("optimizer", "lr_scheduler")]
        if unknown:
            raise ValueError(
                f"Key {describe(unknown[0])} in a dict configure_optimizers returned is not used in manual "
                f"optimization. Received: {describe(spec)}. Return {{'optimizer': ..., 'lr_scheduler': ...}} only; the "
                "Trainer steps no scheduler in manual optimization (call sch.step() in training_step).")
        if "optimizer" not in spec:
            raise ValueError(f"A dict configure_optimizers returned has no 'optimizer' key. Received: "
                             f"{describe(spec)}. Return {{'optimizer': optimizer, 'lr_scheduler': scheduler}}.")
        optimizers.append(spec["optimizer"])
        if spec.get("lr_scheduler") is not None:
            schedulers.append(spec["lr_scheduler"])
    return optimizers, schedulers


def _scheduler(spec: Any) -> Any:
    """The scheduler of a bare scheduler or of Lightning's scheduler dict (its loop keys refused)."""
    if not isinstance(spec, dict):
        return spec
    loop_keys = [key for key in spec if key in _LOOP_KEYS]
    if loop_keys:
        raise ValueError(
            f"{describe(loop_keys[0])} in an lr_scheduler dict configure_optimizers returned has no effect in manual "
            f"optimization (automatic_optimization = False): the Trainer steps no scheduler, training_step does. "
            f"Received: {describe(spec)}. Remove it and call sch.step() (sch.step(metric) for ReduceLROnPlateau) "
            "in training_step, where self.lr_schedulers() returns the schedulers.")
    unknown = [key for key in spec if key not in ("scheduler", "name")]
    if unknown or "scheduler" not in spec:
        raise ValueError(f"An lr_scheduler dict configure_optimizers returned must hold 'scheduler' (and optionally "
                         f"'name'). Received: {describe(spec)}. Return {{'scheduler': scheduler}} or the scheduler.")
    return spec["scheduler"]


def _check_disjoint(optimizers: list[_Optimizer], module: nn.Module) -> None:
    """Refuses a parameter held by two optimizers: each would step it with its own state."""
    names = {id(p): name for name, p in module.named_parameters()}
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                first = owner.setdefault(id(param), index)
                if first != index:
                    same = " (the same optimizer, returned twice)" if optimizers[first] is optimizer else ""
                    raise ValueError(
                        f"configure_optimizers returned optimizers {first} ({type(optimizers[first]).__name__}) and "
                        f"{index} ({type(optimizer).__name__}) that both hold the parameter "
                        f"{names.get(id(param), tuple(param.shape))!r}{same}: both would step it. Give each "
                        "optimizer its own part of the module, e.g. Adam(self.generator.parameters()) and "
                        "Adam(self.discriminator.parameters()).")
