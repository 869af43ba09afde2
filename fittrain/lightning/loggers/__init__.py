"""`lightning.pytorch.loggers`' names, writing through fittrain's trackers.

    Logger             the base class                                                   base.py
    TensorBoardLogger  {save_dir}/{name}/version_{n}, fittrain's TensorBoardTracker     files.py
    CSVLogger          {save_dir}/{name}/version_{n}/metrics.csv, Lightning's columns  files.py
    WandbLogger        fittrain's WandBTracker (pip install fittrain[wandb])            external.py
    MLFlowLogger       fittrain's MLflowTracker (pip install fittrain[mlflow])          external.py
    Lightning's others (CometLogger, NeptuneLogger, LitLogger): building one raises   ../missing.py

Lightning's module paths import too: `loggers.logger` (Logger, DummyLogger, rank_zero_experiment),
`loggers.tensorboard`, `loggers.csv_logs`, `loggers.wandb`, `loggers.mlflow`.
"""

from fittrain.lightning.loggers.base import Logger
from fittrain.lightning.loggers.external import MLFlowLogger, WandbLogger
from fittrain.lightning.loggers.files import CSVLogger, TensorBoardLogger
from fittrain.lightning.missing import LOGGERS, missing

# Lightning's other names: importable, and refused where built, naming the fittrain way (missing.py).
globals().update(missing(LOGGERS, __name__))

__all__ = ["CSVLogger", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]
