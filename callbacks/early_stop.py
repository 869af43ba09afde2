"""EarlyStop: end training when a validation metric stops improving."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any

from fittrain.common.checks import check_bool, check_positive_int
from fittrain.trainer.events import Callback
from fittrain.trainer.monitor import Monitor

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


class EarlyStop(Callback):
    """Stops training when `monitor` has not improved for `patience` validations in a row.

    It decides in `on_validation_end`. A value improves on the best so far when it is lower
    ("min") or higher ("max") by more than `min_delta`. Training then ends after the current
    epoch, or, after a validation in the middle of an epoch (`Trainer(val_every_n_steps=...)`),
    after the current batch; both kinds of validation count alike. The decision is the same on
    every process, because validation metrics are averaged over all of them. The best value and
    the count of validations without improvement are reset at the start of each fit and travel
    inside checkpoints, so a resumed run keeps counting.

    Args:
        monitor: The metric to watch, such as "val_loss" or a name `validation_step` returns.
        mode: "min" if lower is better, "max" if higher is better.
        patience: Validations without improvement after which training stops (at least 1).
        min_delta: The smallest change that counts as an improvement (0 or more).
        check_finite: Stop at once, with a warning, when the monitored value is NaN or infinite.

    Raises:
        ValueError: for a bad argument; and during fit, when `monitor` is not among the metrics.

    Example:
        >>> Trainer(max_epochs=100, callbacks=[EarlyStop("val_loss", patience=5)]).fit(module, train, val)
    """

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 check_finite: bool = True) -> None:
        # The monitored metric, its mode and min_delta, and the best value so far (fittrain/trainer/monitor.py).
        self._monitor = Monitor(monitor, mode, min_delta, owner="EarlyStop")
        check_positive_int("patience", patience, owner="EarlyStop", wanted="an integer of at least 1")
        check_bool("check_finite", check_finite, owner="EarlyStop")
        self.monitor, self.mode, self.patience = monitor, mode, patience
        self.min_delta, self.check_finite = self._monitor.min_delta, check_finite
        self.wait = 0
        self.stopped_epoch: int | None = None
        self._checks = 0

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Forgets the previous fit; a resume then restores the checkpoint's state."""
        self._monitor.reset()
        self.wait, self.stopped_epoch, self._checks = 0, None, 0

    def on_validation_end(self, trainer: "Trainer") -> None:
        """Compares the monitored value with the best so far and stops training when patience ran out;
        the sanity check's validation (Trainer(num_sanity_val_steps=...)) is no check, as in Lightning."""
        if trainer.sanity_checking:
            return
        value = self._read(trainer)
        self._checks += 1
        if self.check_finite and not math.isfinite(value):
            warnings.warn(f"EarlyStop stops training: {self.monitor}={value} is not finite (check_finite=True). "
                          "Lower the learning rate or check the data, or pass check_finite=False.",
                          stacklevel=2)
            self._stop(trainer)
        elif self._monitor.update(value):
            self.wait = 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                logging.getLogger(__name__).info("EarlyStop: %s did not improve on %s for %d validations; stopping.",
                                                 self.monitor, self.best, self.wait)
                self._stop(trainer)

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Warns when no validation ran, so EarlyStop never had anything to decide on."""
        if self._checks == 0:
            warnings.warn(f"EarlyStop(monitor={self.monitor!r}) never ran: no validation happened in this fit. "
                          "Pass a val_loader to fit() (and check val_every_n_epochs or val_every_n_steps).",
                          stacklevel=2)

    @property
    def best(self) -> float | None:
        """The best monitored value so far in this fit (None before the first validation)."""
        return self._monitor.best

    @best.setter
    def best(self, value: float | None) -> None:
        self._monitor.best = value

    def _read(self, trainer: "Trainer") -> float:
        metrics = trainer.state.metrics
        value = self._monitor.read(metrics)
        if value is None:
            raise ValueError(self._monitor.missing(metrics, "`EarlyStop(monitor=...)`"))
        return value

    def _stop(self, trainer: "Trainer") -> None:
        self.stopped_epoch = trainer.state.epoch
        trainer.state.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        """The best value so far and the validations since it."""
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        self.best = None if state.get("best") is None else float(state["best"])
        self.wait = int(state.get("wait", 0))

    def __repr__(self) -> str:
        return (f"EarlyStop(monitor={self.monitor!r}, mode={self.mode!r}, patience={self.patience}, "
                f"min_delta={self.min_delta}, check_finite={self.check_finite})")
