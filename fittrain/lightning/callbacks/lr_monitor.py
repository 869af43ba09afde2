"""`LearningRateMonitor`: Lightning's, with its names and its logging points.

Names: `lr-{Optimizer class}` (or the lr_scheduler dict's "name"); a second optimizer of the same
class is `lr-Adam-1`; an optimizer with several parameter groups gets `/pg1`, `/pg2`, ... (or the
groups' "name"s); `-momentum` and `-weight_decay` follow with `log_momentum`/`log_weight_decay`.
Optimizers with a scheduler come first, in `configure_optimizers`' order, then those without.

When: at the start of each epoch, the rates of "epoch"-interval schedulers and of optimizers without
one; at the start of each batch where Lightning logs (the next optimizer step is a multiple of
`log_every_n_steps`), those of "step"-interval schedulers and of optimizers without one; all at
step `global_step`. The values also go into `trainer.callback_metrics`, as in Lightning.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import torch

from fittrain.common.checks import check_choice
from fittrain.lightning.callbacks.base import Callback
from fittrain.trainer.events import Callback as NativeCallback

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class LearningRateMonitor(Callback):
    """Lightning's `LearningRateMonitor`: logs each optimizer's learning rate to the Trainer's loggers.

    Args:
        logging_interval: "step", "epoch", or None (each scheduler at its own interval).
        log_momentum: Also log the momentum (Adam's first beta), as `{name}-momentum`.
        log_weight_decay: Also log the weight decay, as `{name}-weight_decay`.

    Attributes:
        lrs: Every value logged, by name.

    Raises:
        ValueError: for another logging_interval; when training starts, for a Trainer without loggers.
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval is not None:
            check_choice("logging_interval", logging_interval, ("step", "epoch"), owner="LearningRateMonitor")
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}

    def native_callbacks(self, trainer: "Trainer") -> list[NativeCallback]:
        return [_Monitor(self, trainer), *super().native_callbacks(trainer)]

    def stats(self, trainer: "Trainer", interval: str) -> dict[str, float]:
        """The values to log now: those of schedulers stepping at `interval` ("step", "epoch" or "any")
        and of every optimizer without a scheduler."""
        stats: dict[str, float] = {}
        for (optimizer, interval_of), names in zip(_groups(trainer), _names(trainer)):
            if interval_of is None or interval in (interval_of, "any"):
                for group, name in zip(optimizer.param_groups, names):
                    stats.update(self._group_stats(optimizer, group, name))
        return stats

    def _group_stats(self, optimizer: Any, group: dict[str, Any], name: str) -> dict[str, float]:
        stats = {name: group["lr"]}
        self.lrs.setdefault(name, []).append(group["lr"])
        if self.log_momentum:
            betas = "betas" in optimizer.defaults
            stats[f"{name}-momentum"] = group["betas"][0] if betas else group.get("momentum", 0)
        if self.log_weight_decay:
            stats[f"{name}-weight_decay"] = group["weight_decay"]
        return stats


def _raw(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)


def _groups(trainer: "Trainer") -> list[tuple[Any, str | None]]:
    """(optimizer, its scheduler's interval or None) in Lightning's order: those with a scheduler first."""
    configs = trainer.lr_scheduler_configs
    with_scheduler = [(_raw(config.scheduler.optimizer), config.interval) for config in configs]
    seen = [optimizer for optimizer, _ in with_scheduler]
    alone = [(_raw(opt), None) for opt in trainer.optimizers if not any(_raw(opt) is s for s in seen)]
    return with_scheduler + alone


def _names(trainer: "Trainer") -> list[list[str]]:
    """Lightning's names for each optimizer of `_groups`, one per parameter group."""
    counts: collections.Counter = collections.Counter()
    names = []
    scheduler_names = [config.name for config in trainer.lr_scheduler_configs]
    for i, (optimizer, _) in enumerate(_groups(trainer)):
        given = scheduler_names[i] if i < len(scheduler_names) else None
        base = given or f"lr-{type(optimizer).__name__}"
        if given is None:  # Lightning counts the classes of unnamed ones only, and suffixes every name by that count
            counts[type(optimizer)] += 1
        count = counts[type(optimizer)]
        base = f"{base}-{count - 1}" if count > 1 else base
        groups = optimizer.param_groups
        if len(groups) > 1:
            names.append([f"{base}/{group.get('name', f'pg{j + 1}')}" for j, group in enumerate(groups)])
        else:
            names.append([f"{base}/{groups[0]['name']}" if groups[0].get("name") else base])
    return names


class _Monitor(NativeCallback):
    """The native hooks of a LearningRateMonitor."""

    def __init__(self, owner: LearningRateMonitor, trainer: "Trainer") -> None:
        self.owner, self.trainer = owner, trainer

    def on_train_start(self, trainer: Any) -> None:
        if not self.trainer.loggers:
            raise ValueError("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger. Pass "
                             "Trainer(logger=True) (the default) or a logger.")
        self.owner.lrs = {name: [] for names in _names(self.trainer) for name in names}

    def on_train_batch_start(self, trainer: Any) -> None:
        if self.owner.logging_interval != "epoch" and self.trainer.logs_at_next_step():
            self._log("step" if self.owner.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer: Any) -> None:
        if self.owner.logging_interval != "step":
            self._log("epoch" if self.owner.logging_interval is None else "any")

    def _log(self, interval: str) -> None:
        trainer = self.trainer
        stats = self.owner.stats(trainer, interval)
        if not stats:
            return
        trainer.add_callback_metrics({name: torch.tensor(value) for name, value in stats.items()})
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=trainer.global_step)
