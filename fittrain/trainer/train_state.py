"""`TrainState`: where training stands, saved in every checkpoint and restored on resume."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import torch

from fittrain.trainer.logged import Running, fold_all
from fittrain.trainer.parts import LazyMetrics


@dataclasses.dataclass
class TrainState:
    """Where training stands. Saved in every checkpoint and restored on resume.

    Attributes:
        epoch: The epoch being trained, from 0.
        global_step: Optimizer steps taken.
        batch_idx: Index of the current batch within the epoch.
        loss: The last training loss, detached (a tensor; no device sync until read).
        metrics: The latest value of each metric, as floats (converted when read).
        epoch_logs: The running reductions of `self.log(..., on_epoch=True)` over this epoch's batches.
        should_stop: Set by a callback (such as EarlyStop) to end training after this epoch; set
            during a mid-epoch validation (`val_every_n_steps`), or by `max_time`, it ends training
            after this batch.
        epoch_start_step: `global_step` when the current epoch started (validation counted in
            steps of the epoch: fittrain/trainer/validation_schedule.py).
        time_trained: Seconds of training a resumed checkpoint records (with `max_time`), else 0.
    """

    epoch: int = 0
    global_step: int = 0
    batch_idx: int = 0
    loss: torch.Tensor | None = None
    should_stop: bool = False
    raw_metrics: LazyMetrics = dataclasses.field(default_factory=LazyMetrics)
    # self.log(on_epoch=True) values reduced over this epoch's batches so far (fittrain/trainer/logged.py).
    epoch_logs: dict[str, Running] = dataclasses.field(default_factory=dict)
    epoch_start_step: int = 0
    time_trained: float = 0.0
    # With max_time: returns the seconds trained so far, which checkpoints record (fittrain/trainer/timer.py).
    timed_by: Callable[[], float] | None = dataclasses.field(default=None, repr=False, compare=False)
    _warned_loss: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest value of each metric as floats (reading forces the pending device syncs)."""
        floats = self.raw_metrics.as_floats()
        self._warn_if_not_finite(floats.get("train_loss"))
        return floats

    def check_loss(self) -> None:
        """Warns (once per fit) when the last training loss is NaN or infinite; one device sync."""
        loss = self.raw_metrics.get("train_loss")
        if loss is not None:
            self._warn_if_not_finite(LazyMetrics(train_loss=loss).as_floats()["train_loss"])

    def _warn_if_not_finite(self, loss: float | None) -> None:
        # Checked where the loss becomes a float anyway, never per step: that would sync the device.
        if loss is not None and not math.isfinite(loss) and not self._warned_loss:
            self._warned_loss = True
            warnings.warn(
                f"The training loss is {loss} at optimizer step {self.global_step} (epoch {self.epoch}): training "
                "diverged or a batch holds NaN/inf. Lower the learning rate, clip gradients (GradClip), check the "
                "data, or stop on it with EarlyStop(monitor='train_loss') and a val_loader. (Checked when metrics "
                "are read and at each epoch end, not every step; warned once per fit.)", stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        """The JSON-safe part of the state, for checkpoints."""
        fold_all(self.epoch_logs.values())
        state = {"epoch": self.epoch, "global_step": self.global_step, "batch_idx": self.batch_idx,
                 "should_stop": self.should_stop, "metrics": self.metrics, "epoch_start_step": self.epoch_start_step,
                 # float64 values and weights: exact, so a resumed epoch ends with the same reductions
                 "epoch_logs": {name: [r.reduce_fx, r.sync, r.value, r.weight]
                                for name, r in self.epoch_logs.items()}}
        if self.timed_by is not None:
            state["time_elapsed"] = self.timed_by()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.batch_idx, self.should_stop = int(state["batch_idx"]), bool(state["should_stop"])
        self.raw_metrics = LazyMetrics(state["metrics"])
        # Checkpoints from before these were saved: an epoch of one step per batch; no time recorded.
        self.epoch_start_step = int(state.get("epoch_start_step", max(self.global_step - self.batch_idx - 1, 0)))
        self.time_trained = float(state.get("time_elapsed", 0.0))
        self.epoch_logs = {name: Running(fx, bool(sync), None if value is None else float(value), float(weight))
                           for name, (fx, sync, value, weight) in state.get("epoch_logs", {}).items()}
