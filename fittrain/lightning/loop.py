"""When a fit under Lightning's names validates at an epoch end: only after the epoch's last batch.

Lightning's epoch-end validation is the one after the epoch's last batch (or after a batch that set
`trainer.should_stop`), so an epoch that `max_steps` cuts short ends without one; the native loop
validates at every epoch end, a cut one too. `LightningLoopPlan` is the native `LoopPlan` whose
validation schedule, planned once per fit, is wrapped by `WholeEpochs`: one comparison per epoch end,
nothing per batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from fittrain.trainer.loop_plan import LoopPlan
from fittrain.trainer.validation_schedule import ValidationSchedule

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer
    from fittrain.trainer.train_state import TrainState


class WholeEpochs(ValidationSchedule):
    """`schedule`, validating at an epoch end only when the epoch ran all its batches (or training stops).

    Args:
        schedule: The native schedule of the fit.
        trainer: The Trainer, whose state and batch count tell whether the epoch ran to its end.
    """

    def __init__(self, schedule: ValidationSchedule, trainer: "Trainer") -> None:
        self.schedule, self.trainer = schedule, trainer
        self.mid_epoch = schedule.mid_epoch

    def after_step(self, state: "TrainState") -> bool:
        return self.schedule.after_step(state)

    def at_epoch_end(self, epoch: int) -> bool:
        if not self.schedule.at_epoch_end(epoch):
            return False
        trainer = self.trainer
        batches = trainer.num_training_batches
        whole = math.isinf(batches) or trainer.state.batch_idx + 1 >= batches
        return whole or trainer.state.should_stop


class LightningLoopPlan(LoopPlan):
    """The native loop plan with Lightning's epoch-end validations (`WholeEpochs`).

    Args:
        limits: The Trainer's resolved limits.
        trainer: The Lightning Trainer.
    """

    def __init__(self, limits: Any, trainer: "Trainer") -> None:
        super().__init__(limits)
        self.trainer = trainer

    def plan_fit(self, *args: Any, **kwargs: Any) -> None:
        super().plan_fit(*args, **kwargs)
        self.schedule = WholeEpochs(self.schedule, self.trainer)
