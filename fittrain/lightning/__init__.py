"""`import fittrain.lightning as pl`: Lightning's names for drop-in ports, mapped onto fittrain's own classes.

A Lightning program ports by changing its imports (`lightning.pytorch` -> `fittrain.lightning`):

    fittrain.lightning            LightningModule      TrainModule + Lightning's attributes      module.py
                                  LightningDataModule  DataModule + trainer, save_hyperparameters module.py
                                  Trainer              the native Trainer, Lightning's arguments  trainer/
                                  Callback             hooks (trainer, pl_module, ...)            callbacks/base.py
                                  seed_everything      fittrain.seed_everything
    fittrain.lightning.callbacks  ModelCheckpoint EarlyStopping LearningRateMonitor ModelSummary TQDMProgressBar
    fittrain.lightning.loggers    TensorBoardLogger CSVLogger WandbLogger MLFlowLogger Logger
    fittrain.lightning.utilities  rank_zero_only rank_zero_info rank_zero_warn grad_norm, .types
    fittrain.lightning.strategies DDPStrategy FSDPStrategy: the layout and DDP's arguments
    fittrain.lightning.core, .trainer   the same names where Lightning has them

Lightning's module paths that programs import from import too (most are modules that import the
names from where fittrain defines them): `core.module`, `core.datamodule`, `trainer.trainer`,
`trainer.states`, `callbacks.callback`, `callbacks.checkpoint`, `loggers.logger`,
`loggers.tensorboard`, `loggers.csv_logs`, `loggers.wandb`, `loggers.mlflow`,
`utilities.exceptions`.

Under these names Lightning's semantics hold where a program can observe them: metric names and
what `trainer.callback_metrics` holds when (metrics.py), the sanity check, the default
TensorBoard logger and ModelCheckpoint (build.py), `setup`/`teardown` stages (stages.py), when
schedulers step (module.py), when loggers get rows (connector.py). Processes are started by
`fittrain launch` or torchrun; `Trainer(devices=N)` must describe that job (arguments.py). What
fittrain cannot honour raises when built, naming the fittrain way; docs/migration.md lists every
name: same, different or not applicable, and why.

Modules: module, core; trainer with properties (its attributes), arguments (checks), build (loggers
and callbacks), stages (setup/teardown), loop (epoch-end validations), connector (logging rows),
metrics (the views), sharding (Lightning's per-process data), verbose (result tables), strategies,
trainer/states (trainer.state.fn/stage/status), missing (Lightning's names it lacks: importable, refused when
built); callbacks/, loggers/, utilities/. May import every fittrain layer (it is the top one); never
`lightning`.
"""

from fittrain.accelerator.seeding import seed_everything
from fittrain.lightning import callbacks, loggers, strategies, utilities
from fittrain.lightning.callbacks import Callback
from fittrain.lightning.module import LightningDataModule, LightningModule
from fittrain.lightning.trainer import Trainer

__all__ = ["Callback", "LightningDataModule", "LightningModule", "Trainer", "callbacks", "loggers",
           "seed_everything", "strategies", "utilities"]
