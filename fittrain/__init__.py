"""fittrain: an Accelerate-compatible training core and a callback-based Trainer.

Re-exports only. The architecture is described in docs/design.md, and the public API in the user
docs it links to (docs/index.md).
"""

from typing import Any

from fittrain.accelerator.accelerator import Accelerator
from fittrain.accelerator.configuration import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from fittrain.accelerator.partial_state import PartialState
from fittrain.accelerator.seeding import seed_everything
from fittrain.checkpoint import CheckpointError, ProjectConfiguration
from fittrain.common.version import package_version
from fittrain.distributed.layout import ParallelismConfig
from fittrain.distributed.process_state import DistributedType
from fittrain.launchers import debug_launcher, notebook_launcher
from fittrain.trainer.datamodule import DataModule
from fittrain.trainer.events import Callback, Event
from fittrain.trainer.module import TrainModule
from fittrain.trainer.trainer import Trainer, TrainState

__all__ = [
    "Accelerator", "AutocastKwargs", "Callback", "CheckpointError", "DDPCommunicationHookType", "DataModule",
    "DataLoaderConfiguration", "DistributedDataParallelKwargs", "DistributedType", "Event", "GradScalerKwargs",
    "GradientAccumulationPlugin", "InitProcessGroupKwargs", "ParallelismConfig", "PartialState", "ProfileKwargs",
    "TorchDynamoPlugin", "ProjectConfiguration", "TrainModule", "TrainState", "Trainer", "debug_launcher",
    "find_executable_batch_size", "notebook_launcher", "seed_everything", "skip_first_batches",
]


def __getattr__(name: str) -> Any:
    """`fittrain.__version__`: the installed package's version (setup.cfg's), looked up when first read;
    and Accelerate's top-level helpers `skip_first_batches` and `find_executable_batch_size`.

    Looked up lazily so that `import fittrain` does not pay for a scan of the installed packages
    (nor for `fittrain.utils`' imports).
    """
    if name in ("skip_first_batches", "find_executable_batch_size"):
        from fittrain import utils  # on first use: utils imports much that `import fittrain` need not

        return getattr(utils, name)
    if name != "__version__":
        raise AttributeError(f"module 'fittrain' has no attribute {name!r}")
    return package_version()
