"""fittrain: an Accelerate-compatible training core and a callback-based Trainer.

Re-exports only. The architecture is described in docs/design.md, and the public API in the user
docs it links to (docs/index.md).
"""

from .accelerator import Accelerator
from .checkpoint import CheckpointError, ProjectConfiguration
from .events import Callback, Event
from .module import TrainModule
from .state import DistributedType
from .trainer import Trainer, TrainState

__all__ = [
    "Accelerator", "Callback", "CheckpointError", "DistributedType", "Event", "ProjectConfiguration",
    "TrainModule", "TrainState", "Trainer",
]
__version__ = "0.1.0"
