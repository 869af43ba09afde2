"""`DataModule`: the data of a fit in one object (Lightning's `LightningDataModule`).

`Trainer.fit(module, datamodule=dm)` (and `validate`, `test`, `predict`) calls, in order::

    dm.prepare_data()        once per node: on each node's main process, the others waiting
    dm.setup(stage)          on every process; stage is "fit", "validate", "test" or "predict"
    dm.train_dataloader()    and dm.val_dataloader() if the subclass defines it   (fit)
    dm.val_dataloader() / dm.test_dataloader() / dm.predict_dataloader()        (the others)
    ... the loop ...
    dm.teardown(stage)       on every process, also when the loop raised

A DataModule whose class defines `state_dict` and `load_state_dict` has that state saved in every
checkpoint of the fit and restored on resume, beside the callbacks' (fittrain/trainer/callback_states.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from fittrain.common.reprs import short_repr
from fittrain.trainer.module import TrainModule

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator

#: The loader method each stage reads, and the Trainer argument it stands for.
_LOADERS = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}


class DataModule:
    """Base class for the data of a fit: override what you need.

    Example:
        >>> class Numbers(DataModule):
        ...     def setup(self, stage):
        ...         x = torch.randn(64, 3)
        ...         self.data = TensorDataset(x, x.sum(1, keepdim=True))
        ...     def train_dataloader(self):
        ...         return DataLoader(self.data, batch_size=8, shuffle=True)
        >>> Trainer(max_epochs=2).fit(module, datamodule=Numbers())
    """

    def prepare_data(self) -> None:
        """Once per node, before `setup`: download or write files (not state: other processes skip it)."""

    def setup(self, stage: str) -> None:
        """On every process: build the datasets for `stage` ("fit", "validate", "test" or "predict")."""

    def teardown(self, stage: str) -> None:
        """On every process, after the stage ran (also when it raised)."""

    def train_dataloader(self) -> Any:
        """The training loader (needed by `fit`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no train_dataloader(), which fit(datamodule=...) "
                                  "needs. Define it to return the training DataLoader.")

    def val_dataloader(self) -> Any:
        """The validation loader; without it, fit does not validate."""
        raise NotImplementedError(f"{type(self).__name__} defines no val_dataloader(), which validate(datamodule=...) "
                                  "needs. Define it to return the validation DataLoader.")

    def test_dataloader(self) -> Any:
        """The test loader (needed by `test`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no test_dataloader(), which test(datamodule=...) "
                                  "needs. Define it to return the test DataLoader.")

    def predict_dataloader(self) -> Any:
        """The prediction loader (needed by `predict`)."""
        raise NotImplementedError(f"{type(self).__name__} defines no predict_dataloader(), which "
                                  "predict(datamodule=...) needs. Define it to return the DataLoader to predict on.")


def defines(datamodule: DataModule, method: str) -> bool:
    """Whether `datamodule`'s class overrides `DataModule.<method>`."""
    return getattr(type(datamodule), method, None) is not getattr(DataModule, method)


def check_datamodule(datamodule: Any, method: str) -> DataModule:
    """Returns `datamodule` when it is a DataModule.

    Raises:
        TypeError: naming `method`'s argument, the value received and the fix.
    """
    if not isinstance(datamodule, DataModule):
        raise TypeError(f"Trainer.{method}(datamodule=...) takes a fittrain.DataModule. Received: "
                        f"{short_repr(datamodule)} ({type(datamodule).__name__}). Subclass fittrain.DataModule "
                        "(Lightning's LightningDataModule) or pass the loaders themselves.")
    return datamodule


def start_stage(datamodule: DataModule, stage: str, accelerator: "Accelerator") -> None:
    """`prepare_data` on each node's main process while the others wait, then `setup(stage)` everywhere."""
    if accelerator.is_local_main_process:
        datamodule.prepare_data()
    accelerator.wait_for_everyone()  # a file prepare_data writes exists on this node before setup reads it
    datamodule.setup(stage)


def stage_loader(datamodule: DataModule, stage: str) -> Any:
    """The loader `validate`, `test` or `predict` runs on."""
    return getattr(datamodule, _LOADERS[stage])()


def pick(method: str, names: tuple[str, str], values: tuple[Any, Any]) -> Any:
    """One loader given under fittrain's name or Lightning's (`train_loader` or `train_dataloaders`).

    Raises:
        TypeError: when both names are given.
    """
    ours, lightnings = values
    if ours is not None and lightnings is not None:
        raise TypeError(f"Trainer.{method}() received both {names[0]}= and {names[1]}= (Lightning's name for the "
                        "same argument). Pass one of them.")
    return ours if ours is not None else lightnings


class DataStages:
    """Where the Trainer's calls get their loaders: given (under fittrain's or Lightning's names), or
    read from a DataModule, whose stage this object starts and ends.

    Args:
        accelerator: The Trainer's, which says which process prepares the data of its node.

    Attributes:
        datamodule: The DataModule of the call running now, or None.
    """

    def __init__(self, accelerator: "Accelerator") -> None:
        self.accelerator = accelerator
        self.datamodule: DataModule | None = None

    def fit_loaders(self, module: Any, train: tuple[Any, Any], val: tuple[Any, Any],
                    datamodule: Any) -> tuple[Any, Any]:
        """fit's (train, val) loaders, from (fittrain's, Lightning's) argument pairs or from `datamodule`
        (set up here), whose val_dataloader() is used when the module can validate.

        Raises:
            TypeError: for a loader given under both names, or loaders beside a datamodule.
        """
        train_loader = pick("fit", ("train_loader", "train_dataloaders"), train)
        val_loader = pick("fit", ("val_loader", "val_dataloaders"), val)
        if datamodule is None:
            return train_loader, val_loader  # a missing one is refused by the checks of fit's inputs
        self._start("fit", datamodule, given=train_loader is not None or val_loader is not None)
        validates = (defines(datamodule, "val_dataloader") and isinstance(module, TrainModule)
                     and module.has_validation_step())
        return self._read("fit", lambda: (datamodule.train_dataloader(),
                                          datamodule.val_dataloader() if validates else None))

    def loader(self, stage: str, loader: Any, dataloaders: Any, datamodule: Any) -> Any:
        """The loader of validate, test or predict: given under either name, or from `datamodule`."""
        loader = pick(stage, ("loader", "dataloaders"), (loader, dataloaders))
        if datamodule is None:
            return loader  # a missing one is refused by check_inputs
        self._start(stage, datamodule, given=loader is not None)
        return self._read(stage, lambda: stage_loader(datamodule, stage))

    def end(self, stage: str) -> None:
        """`teardown(stage)` of the DataModule the stage set up, if any."""
        datamodule, self.datamodule = self.datamodule, None
        if datamodule is not None:
            datamodule.teardown(stage)

    def _start(self, stage: str, datamodule: Any, given: bool) -> None:
        if given:
            raise TypeError(f"Trainer.{stage}() received both loaders and a datamodule. Pass one: the loaders, or "
                            "the datamodule whose *_dataloader() methods return them.")
        self.datamodule = check_datamodule(datamodule, stage)
        start_stage(self.datamodule, stage, self.accelerator)

    def _read(self, stage: str, read: Callable[[], Any]) -> Any:
        """Returns `read()` (the DataModule's loaders); if it raises, the stage is torn down first."""
        try:
            return read()
        except BaseException:
            self.end(stage)
            raise
