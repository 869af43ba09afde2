"""`lightning.pytorch.trainer.states`' names: what `trainer.state.fn`, `.stage` and `.status` say.

`Trainer.state` stays fittrain's `TrainState` (epoch, global_step, ... saved in checkpoints); under
fittrain.lightning it is a `LightningState`, which adds Lightning's three readings, worked out from
the Trainer when read (nothing more to keep in step):

- `fn`: the stage last started (`TrainerFn`: "fit", "validate", "test", "predict"); it stays after
  the stage ends, as Lightning's does.
- `stage`: what runs now (`RunningStage`: "train", "sanity_check", "validate", "test", "predict"),
  None between stages.
- `status`: "initializing" before any stage, "running" in one, "finished" after.

The enums are strings too, so `trainer.state.fn == "fit"` holds as in Lightning.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fittrain.trainer.train_state import TrainState


class TrainerFn(str, enum.Enum):
    """The Trainer method running: `trainer.state.fn`."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(str, enum.Enum):
    """The loop running: `trainer.state.stage`."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)


class TrainerStatus(str, enum.Enum):
    """Whether a stage runs: `trainer.state.status`."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class LightningState(TrainState):
    """fittrain's `TrainState`, with Lightning's `fn`, `stage` and `status` read off `trainer`."""

    trainer: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def fn(self) -> TrainerFn | None:
        stage = self.trainer.started_stage
        return TrainerFn(stage) if stage is not None else None

    @property
    def stage(self) -> RunningStage | None:
        running = self.trainer.running_stage
        return RunningStage(running) if running is not None else None

    @property
    def status(self) -> TrainerStatus:
        if self.trainer.started_stage is None:
            return TrainerStatus.INITIALIZING
        return TrainerStatus.RUNNING if self.trainer.running_stage is not None else TrainerStatus.FINISHED


__all__ = ["LightningState", "RunningStage", "TrainerFn", "TrainerStatus"]
