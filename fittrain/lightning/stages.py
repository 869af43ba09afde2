"""Lightning's stage hooks around the native DataStages: where `setup(stage)` and `teardown(stage)`
of the callbacks and the module run, and where loaders come from when none is given.

Lightning's order, which `LightningStages` keeps (the datamodule's part is the native one):

    datamodule.prepare_data()    once per node          (fittrain/trainer/datamodule.py)
    datamodule.setup(stage)
    callback.setup(trainer, module, stage)   for each Lightning callback, in list order
    module.setup(stage)
    ... the stage (on_fit_start, ...) ...
    datamodule.teardown(stage), callback.teardown(...), module.teardown(stage), logger.finalize("success")

Without loaders and without a datamodule, the module's own `train_dataloader()`,
`val_dataloader()`, ... are read, after its `setup` (it may build the datasets there), as Lightning
does. On several processes each loader is rebuilt so that every process gets Lightning's
DistributedSampler share (fittrain/lightning/sharding.py). The loggers' versions are settled at
setup, the main process's choice on every process, so that `trainer.log_dir` and the checkpoint
folder are the same everywhere.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from fittrain.lightning.sharding import lightning_sharded
from fittrain.trainer.datamodule import DataStages

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer

#: The module method each stage reads its loader from, when neither loaders nor a datamodule are given.
MODULE_LOADERS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


def _module_loader(module: Any, method: str, needed_by: str | None = None) -> Any:
    """`module.<method>()` when the module's class defines it, else None; or, when the loader is
    `needed_by` a stage ("fit", "validate", ...) that was given none, a TypeError in Lightning's terms.
    """
    if callable(getattr(type(module), method, None)):
        return getattr(module, method)()
    if needed_by is not None:
        argument = "train_dataloaders" if needed_by == "fit" else "dataloaders"
        raise TypeError(f"Trainer.{needed_by}() received no {argument} and no datamodule, and "
                        f"{type(module).__name__} defines no {method}(). Pass {needed_by}(model, {argument}="
                        f"DataLoader(...)) or {needed_by}(model, datamodule=...), or define {method}() on the module.")
    return None


class LightningStages(DataStages):
    """The native DataStages plus Lightning's setup and teardown hooks (see the module docstring).

    Args:
        trainer: The Lightning Trainer whose callbacks, module and loggers take part.
    """

    def __init__(self, trainer: "Trainer") -> None:
        super().__init__(trainer.accelerator)
        self.trainer = trainer
        self._module: Any = None
        self.last_train_loader: Any = None  # for Trainer.estimated_stepping_batches
        self.last_loader: Any = None  # validate's, test's or predict's, as run

    def fit_loaders(self, module: Any, train: tuple[Any, Any], val: tuple[Any, Any],
                    datamodule: Any) -> tuple[Any, Any]:
        if datamodule is None and all(loader is None for loader in train):
            self._setup("fit", module)
            train = (_module_loader(module, "train_dataloader", needed_by="fit"), None)
            if all(loader is None for loader in val):
                val = (_module_loader(module, "val_dataloader"), None)
            loaders = super().fit_loaders(module, train, val, None)
        else:
            loaders = super().fit_loaders(module, train, val, datamodule)
            self._setup("fit", module)
        self.last_train_loader = loaders[0]
        world, overfit = self.accelerator.num_processes, bool(getattr(self.trainer, "overfit_batches", 0))
        return (lightning_sharded(loaders[0], world, "train", overfit),
                lightning_sharded(loaders[1], world, "eval", overfit))

    def loader(self, stage: str, loader: Any, dataloaders: Any, datamodule: Any) -> Any:
        module = self.trainer.lightning_module
        if datamodule is None and loader is None and dataloaders is None:
            self._setup(stage, module)
            found = super().loader(stage, _module_loader(module, MODULE_LOADERS[stage], needed_by=stage), None, None)
        else:
            found = super().loader(stage, loader, dataloaders, datamodule)
            self._setup(stage, module)
        self.last_loader = lightning_sharded(found, self.accelerator.num_processes,
                                             "predict" if stage == "predict" else "eval")
        return self.last_loader

    def end(self, stage: str) -> None:
        """The datamodule's teardown (native), then the callbacks', the module's and the loggers' ends;
        after an exception only the datamodule's (Lightning tears the others down on success only)."""
        failed = sys.exc_info()[0] is not None
        super().end(stage)
        module, self._module = self._module, None
        trainer = self.trainer
        if module is None:
            return
        for logger in trainer.loggers:
            logger.finalize("failed" if failed else "success")
        if failed:
            return
        for callback in trainer.lightning_callbacks:
            callback.teardown(trainer, module, stage=stage)
        teardown = getattr(module, "teardown", None)
        if callable(teardown):
            teardown(stage=stage)

    def _setup(self, stage: str, module: Any) -> None:
        trainer = self.trainer
        trainer.settle_logger_versions()
        self._module = module
        for callback in trainer.lightning_callbacks:
            callback.setup(trainer, module, stage=stage)
        setup = getattr(module, "setup", None)
        if callable(setup):
            setup(stage=stage)
        if trainer.enable_autolog_hparams and trainer.loggers:
            self._log_hyperparams(module)
        for logger in trainer.loggers:
            logger.save()

    def _log_hyperparams(self, module: Any) -> None:
        """Lightning's: the module's hparams (and the datamodule's) to every logger when a stage starts.

        Raises:
            ValueError: when the module and the datamodule record one name with two values, as in Lightning.
        """
        datamodule = self.trainer.datamodule
        module_has, datamodule_has = "hparams" in module.__dict__, "hparams" in getattr(datamodule, "__dict__", {})
        if not (module_has or datamodule_has):
            return  # Lightning logs hyperparameters only after save_hyperparameters()
        hparams = dict(module.__dict__.get("hparams") or {})
        for name, value in dict(getattr(datamodule, "hparams", None) or {}).items():
            if name in hparams and hparams[name] != value:
                raise ValueError(f"Error while merging hparams: the keys {name!r} are present in both the "
                                 "LightningModule's and LightningDataModule's hparams but have different values.")
            hparams[name] = value
        for logger in self.trainer.loggers:
            logger.log_hyperparams(hparams)
