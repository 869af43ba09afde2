"""`EarlyStopping`: Lightning's, run by fittrain's `EarlyStop` with Lightning's checking rules.

What differs from the native `EarlyStop`, because Lightning programs observe it:

- It checks at the end of each training epoch when validation runs once per epoch (Lightning's
  default `check_on_train_epoch_end=None` then means True), else after each validation; never in the
  sanity check, nor outside `fit`. So a metric logged in `on_train_epoch_end` can be monitored.
- It reads `trainer.callback_metrics` (what `self.log` recorded); a missing metric is an error with
  `strict=True`, else skipped (with a warning when `verbose`).
- `patience=0` stops at the first check without improvement; `stopping_threshold` and
  `divergence_threshold` stop at once when crossed.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from fittrain.callbacks.early_stop import EarlyStop
from fittrain.common.reprs import short_repr
from fittrain.lightning.callbacks.base import Callback

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class EarlyStopping(Callback):
    """Lightning's `EarlyStopping`: stop when `monitor` has not improved for `patience` checks.

    Args:
        monitor: The metric, a name in `trainer.callback_metrics`.
        min_delta: The smallest change that counts as an improvement.
        patience: Checks without improvement after which training stops.
        verbose: Log each decision.
        mode: "min" or "max".
        strict: A missing metric is an error (else skipped).
        check_finite: Stop when the metric is NaN or infinite.
        stopping_threshold: Stop as soon as the metric is better than this.
        divergence_threshold: Stop as soon as the metric is worse than this.
        check_on_train_epoch_end: Check at the end of the training epoch (True), after validation
            (False), or Lightning's choice (None: at the epoch end when validation runs every epoch).
        log_rank_zero_only: Log the decisions on the main process only.

    Raises:
        ValueError: for a bad monitor, mode, min_delta or patience.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise ValueError(f"`EarlyStopping(patience=...)` must be an int of at least 0. Received: "
                             f"patience={short_repr(patience)}.")
        self.native = _Check(self, monitor, mode, abs(min_delta) if isinstance(min_delta, (int, float)) else min_delta,
                             check_finite)
        self.monitor, self.mode, self.patience, self.verbose = monitor, mode, patience, verbose
        self.min_delta = abs(float(min_delta))
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        self.stopping_reason_message: str | None = None

    def native_callbacks(self, trainer: "Trainer") -> list[Any]:
        """The native `EarlyStop` doing the checks (and an adapter for hooks a subclass overrides)."""
        return [self.native, *super().native_callbacks(trainer)]

    @property
    def wait_count(self) -> int:
        """Checks since the last improvement."""
        return self.native.wait

    @property
    def stopped_epoch(self) -> int:
        """The epoch training was stopped at (0 when it was not)."""
        return self.native.stopped_epoch or 0

    @property
    def best_score(self) -> torch.Tensor:
        """The best value so far (inf for "min", -inf for "max" before the first check)."""
        best = self.native.best
        return torch.tensor(best if best is not None else (math.inf if self.mode == "min" else -math.inf))

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch,
                "best_score": self.best_score, "patience": self.patience}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.native.load_state_dict({"best": float(state_dict["best_score"]), "wait": state_dict["wait_count"]})
        self.native.stopped_epoch = state_dict.get("stopped_epoch")


class _Check(EarlyStop):
    """The native EarlyStop, checking where and how Lightning's EarlyStopping does (see the module docstring)."""

    def __init__(self, owner: EarlyStopping, monitor: str, mode: str, min_delta: Any, check_finite: bool) -> None:
        super().__init__(monitor, mode, patience=1, min_delta=min_delta, check_finite=check_finite)
        self.owner = owner
        self._at_epoch_end = False

    def on_fit_start(self, trainer: "Trainer") -> None:
        super().on_fit_start(trainer)
        choice = self.owner.check_on_train_epoch_end
        self._at_epoch_end = choice if choice is not None else trainer.checks_validation_every_epoch

    def on_validation_end(self, trainer: "Trainer") -> None:
        if not self._at_epoch_end and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Lightning does not warn when no check ran."""

    def _check(self, trainer: "Trainer") -> None:
        owner = self.owner
        metrics = trainer.callback_metrics
        if owner.monitor not in metrics:
            message = (f"Early stopping conditioned on metric `{owner.monitor}` which is not available. Pass in or "
                       f"modify your `EarlyStopping` callback to use any of the following: `{'`, `'.join(metrics)}`")
            if owner.strict:
                raise RuntimeError(message)
            if owner.verbose:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        if getattr(trainer, "fast_dev_run", False):
            return  # Lightning disables early stopping in a fast_dev_run
        value = float(metrics[owner.monitor])
        stop, reason = self._decide(value)
        # Every process decides on the same (reduced) metric; any process's stop stops all, as in Lightning.
        stop = bool(trainer.accelerator.reduce(torch.tensor([float(stop)], device=trainer.accelerator.device),
                                               reduction="max").item()) if trainer.world_size > 1 else stop
        if stop:
            self.stopped_epoch = trainer.current_epoch
            owner.stopping_reason_message = reason
            trainer.should_stop = True
        if reason and owner.verbose and (trainer.is_global_zero or not owner.log_rank_zero_only):
            logging.getLogger("fittrain.lightning").info(reason)

    def _decide(self, value: float) -> tuple[bool, str | None]:
        owner, better = self.owner, (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        if owner.check_finite and not math.isfinite(value):
            return True, f"Monitored metric {owner.monitor} = {value} is not finite. Signaling Trainer to stop."
        if owner.stopping_threshold is not None and better(value, owner.stopping_threshold):
            return True, f"Stopping threshold reached: {owner.monitor} = {value}. Signaling Trainer to stop."
        if owner.divergence_threshold is not None and better(owner.divergence_threshold, value):
            return True, f"Divergence threshold reached: {owner.monitor} = {value}. Signaling Trainer to stop."
        if self._monitor.update(value):
            self.wait = 0
            return False, f"Metric {owner.monitor} improved. New best score: {value:.3f}"
        self.wait += 1
        if self.wait >= owner.patience:
            return True, (f"Monitored metric {owner.monitor} did not improve in the last {self.wait} records. "
                          f"Best score: {self.best:.3f}. Signaling Trainer to stop.")
        return False, None
