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


def __getattr__(name: str) -> str:
    """`fittrain.__version__`: the installed package's version (setup.cfg's), looked up when first read.

    Looked up lazily so that `import fittrain` does not pay for a scan of the installed packages.
    """
    if name != "__version__":
        raise AttributeError(f"module 'fittrain' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fittrain")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"
