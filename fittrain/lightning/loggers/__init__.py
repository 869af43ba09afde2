"""`lightning.pytorch.loggers`' names, writing through fittrain's trackers.

    Logger             the base class                                                   base.py
    TensorBoardLogger  {save_dir}/{name}/version_{n}, fittrain's TensorBoardTracker     files.py
    CSVLogger          {save_dir}/{name}/version_{n}/metrics.csv, Lightning's columns  files.py
    WandbLogger        fittrain's WandBTracker (pip install fittrain[wandb])            external.py
    MLFlowLogger       fittrain's MLflowTracker (pip install fittrain[mlflow])          external.py
"""

from fittrain.lightning.loggers.base import Logger
from fittrain.lightning.loggers.external import MLFlowLogger, WandbLogger
from fittrain.lightning.loggers.files import CSVLogger, TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
