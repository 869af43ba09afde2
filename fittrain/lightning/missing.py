"""Lightning's names that fittrain.lightning does not provide, each kept as a class that refuses to be built.

A program that imports one ports with its imports changed like the rest, and fails where it builds
the object, with what to do in fittrain instead, rather than at its import with a bare ImportError.
Every public name of `lightning.pytorch.callbacks`, `.loggers` and `.strategies` is therefore one
of fittrain.lightning's, real or missing (tests/lightning compares the lists with Lightning's).
"""

from __future__ import annotations

from typing import Any, NoReturn


class Missing:
    """Base of the names fittrain.lightning does not provide; `INSTEAD` says what to do instead."""

    INSTEAD = ""

    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn:
        name = type(self).__name__
        raise NotImplementedError(f"{name}: fittrain.lightning does not provide Lightning's {name}. Instead: "
                                  f"{self.INSTEAD}. docs/migration.md lists every Lightning name.")


def missing(instead: dict[str, str], module: str) -> dict[str, type[Missing]]:
    """One `Missing` class per name of `instead` (name -> what to do instead), as `module`'s names."""
    return {name: type(name, (Missing,), {"INSTEAD": way, "__module__": module,
                                          "__doc__": f"Not provided by fittrain.lightning. Instead: {way}."})
            for name, way in instead.items()}


_WRITE_A_CALLBACK = "write a fittrain.lightning.Callback"

#: lightning.pytorch.callbacks' names that fittrain.lightning.callbacks lacks.
CALLBACKS = {
    "BackboneFinetuning": f"{_WRITE_A_CALLBACK} that sets requires_grad in on_train_epoch_start",
    "BaseFinetuning": f"{_WRITE_A_CALLBACK} that sets requires_grad in on_train_epoch_start",
    "BasePredictionWriter": "trainer.predict(...) returns the predictions; or write them from a Callback's "
                            "on_predict_batch_end",
    "BatchSizeFinder": "fittrain has no tuner: pass the batch size you chose",
    "DeviceStatsMonitor": f"{_WRITE_A_CALLBACK} that logs torch.cuda.memory_stats() values",
    "EMAWeightAveraging": f"{_WRITE_A_CALLBACK} that updates a torch.optim.swa_utils.AveragedModel",
    "GradientAccumulationScheduler": "Trainer(accumulate_grad_batches=n), one n for the whole fit",
    "LambdaCallback": "subclass fittrain.lightning.Callback with the hooks you need",
    "LearningRateFinder": "fittrain has no tuner: pass the learning rate you chose",
    "ModelPruning": f"{_WRITE_A_CALLBACK} that applies torch.nn.utils.prune",
    "OnExceptionCheckpoint": "ModelCheckpoint; fittrain also saves and exits 75 on SIGTERM/SIGUSR1 (preemption)",
    "RichModelSummary": "ModelSummary, a plain-text table",
    "RichProgressBar": "TQDMProgressBar: fittrain draws with tqdm",
    "SpikeDetection": f"{_WRITE_A_CALLBACK} that compares losses in on_train_batch_end",
    "StochasticWeightAveraging": f"{_WRITE_A_CALLBACK} that updates a torch.optim.swa_utils.AveragedModel",
    "ThroughputMonitor": f"{_WRITE_A_CALLBACK} that times batches and logs their rate",
    "Timer": "Trainer(max_time=...) ends the fit after that long",
    "WeightAveraging": f"{_WRITE_A_CALLBACK} that updates a torch.optim.swa_utils.AveragedModel",
}

#: lightning.pytorch.loggers' names that fittrain.lightning.loggers lacks.
LOGGERS = {name: "TensorBoardLogger, CSVLogger, WandbLogger or MLFlowLogger, or a subclass of "
                 "fittrain.lightning.loggers.Logger" for name in ("CometLogger", "LitLogger", "NeptuneLogger")}

#: lightning.pytorch.strategies' names that fittrain.lightning.strategies lacks.
STRATEGIES = {
    "DeepSpeedStrategy": "fittrain drives no DeepSpeed: FSDPStrategy() (FSDP2) shards parameters, gradients and "
                         "optimizer state",
    "ModelParallelStrategy": "give the native Trainer a fittrain.ParallelismConfig (tensor parallelism with FSDP2)",
    "SingleDeviceStrategy": "leave strategy out and start one process",
}
