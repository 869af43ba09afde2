"""Reading `configure_optimizers` for manual optimization: several optimizers and schedulers.

With `automatic_optimization = False`, `configure_optimizers` may return any of Lightning's forms:

    optimizer                                   one optimizer
    [opt_g, opt_d]                              a list (or tuple) of optimizers
    ([opt_g, opt_d], [sched_g, sched_d])        optimizers and schedulers, in two lists
    (opt, sched)                                fittrain's pair
    {"optimizer": opt, "lr_scheduler": sched}   one dict, or a list/tuple of such dicts

A scheduler may be given as Lightning's dict `{"scheduler": s}` (with an optional "name"). The
keys that tell the loop when to step it ("interval", "frequency", "monitor", "strict",
"reduce_on_plateau") are refused: in manual optimization the Trainer steps no scheduler, the
training_step calls `sch.step()` itself (Lightning ignores those keys with a warning).

Every optimizer must train parameters of the module, and no parameter may belong to two of them:
both would step it, each with its own state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fittrain.trainer.schedules import _check_owned
from fittrain.trainer.parts import describe

if TYPE_CHECKING:
    from fittrain.trainer.module import TrainModule

_Optimizer = torch.optim.Optimizer
_Scheduler = torch.optim.lr_scheduler.LRScheduler
_FORMS = ("an optimizer, a list of optimizers, ([optimizers], [schedulers]), or a list of {'optimizer': ..., "
          "'lr_scheduler': ...} dicts")
_LOOP_KEYS = ("interval", "frequency", "monitor", "strict", "reduce_on_plateau")


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
        raise TypeError(f"configure_optimizers must return {_FORMS}. Received: {describe(result)}.")
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


def _check_disjoint(optimizers: list[_Optimizer], module: torch.nn.Module) -> None:
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
