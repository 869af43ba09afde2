"""Experiment trackers, with Accelerate's API: where metrics and hyperparameters go.

A tracker is a `GeneralTracker` (Accelerate's shape): `name`, `requires_logging_directory`,
`tracker` (the underlying object), `store_init_configuration(values)`, `log(values, step)`,
`finish()`. Built in:

    "tensorboard"  TensorBoardTracker  {logging_dir}/{run}/events.out.tfevents.*  (hparams plugin)
    "csv"          CSVTracker          {logging_dir}/{run}/metrics.csv    step,name,value,wall_time
    "jsonl"        JSONLTracker        {logging_dir}/{run}/metrics.jsonl  {"step", "wall_time", "values"}
    "wandb"        WandBTracker        wandb.init(project=...)   pip install fittrain[wandb]
    "mlflow"       MLflowTracker       an MlflowClient run       pip install fittrain[mlflow]

`log_with` takes "all" (as in Accelerate: those of tensorboard, wandb and mlflow that are installed),
a name, a `LoggerType`, a tracker instance, or a list of these (`registry.resolve_trackers`). Two users:

    Accelerator(log_with=["tensorboard", "csv"], project_dir="runs/a")   a custom loop
        accelerator.init_trackers("exp1", config={"lr": 3e-4})           -> runs/a/exp1/
        accelerator.log({"train_loss": loss}, step=step)
        accelerator.get_tracker("tensorboard", unwrap=True)              -> a SummaryWriter
        accelerator.end_training()                                       finishes every tracker
    Trainer(callbacks=[Logger(log_with=["tensorboard", "csv"])])         the Trainer
        one folder per run, {logging_dir}/{run name}; a resumed run continues its folder

Only the main process opens trackers; the others hold `NoOpTracker`s, which absorb every call.
A resumed run passes `purge_step` to the file trackers: TensorBoard then hides, and CSV/JSONL
drop, what the interrupted run wrote after its checkpoint, which the resumed run writes again.

Modules: base (GeneralTracker, NoOpTracker, RunInfo, value checks); tensorboard (EventWriter:
one event per logging point; TensorBoardTracker); files (CSVTracker, JSONLTracker); external
(WandBTracker, MLflowTracker, imported lazily); registry (LoggerType, resolve_trackers,
open_trackers); runs (run names).

May import: `common` only. The Accelerator (`accelerator.tracking`) and the Trainer's Logger open
and feed trackers; trackers know neither.
"""

from fittrain.trackers.base import GeneralTracker, NoOpTracker, RunInfo
from fittrain.trackers.external import MLflowTracker, WandBTracker
from fittrain.trackers.files import CSVTracker, JSONLTracker
from fittrain.trackers.registry import LoggerType, resolve_trackers
from fittrain.trackers.tensorboard import EventWriter, TensorBoardTracker

__all__ = ["CSVTracker", "EventWriter", "GeneralTracker", "JSONLTracker", "LoggerType", "MLflowTracker",
           "NoOpTracker", "RunInfo", "TensorBoardTracker", "WandBTracker", "resolve_trackers"]
