"""The type aliases Lightning programs annotate their hooks with (`lightning.pytorch.utilities.types`).

They are for annotations only: fittrain checks what the hooks return where it uses it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import Tensor
from torch.optim import Optimizer

#: What training_step, validation_step and test_step return: a loss, a dict with "loss", or None.
STEP_OUTPUT = Tensor | Mapping[str, Any] | None
#: What `*_dataloader()` hooks return.
TRAIN_DATALOADERS = Any
EVAL_DATALOADERS = Any
#: A learning-rate scheduler (torch's LRScheduler or ReduceLROnPlateau).
LRSchedulerTypeUnion = Any
#: The forms configure_optimizers may return: an optimizer, several, with schedulers, or a config dict.
OptimizerLRScheduler = Optimizer | Sequence[Optimizer] | tuple | Mapping[str, Any] | None

__all__ = ["EVAL_DATALOADERS", "LRSchedulerTypeUnion", "OptimizerLRScheduler", "STEP_OUTPUT", "TRAIN_DATALOADERS"]
