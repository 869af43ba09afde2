"""fittrain: an Accelerate-compatible training core and a callback-based Trainer.

Re-exports only; see DESIGN.md for the public contract.
"""

from .accelerator import Accelerator
from .checkpoint import ProjectConfiguration
from .state import DistributedType
from .storage import CheckpointError

__all__ = ["Accelerator", "CheckpointError", "DistributedType", "ProjectConfiguration"]
__version__ = "0.1.0"
