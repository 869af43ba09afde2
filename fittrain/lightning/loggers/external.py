"""`WandbLogger` and `MLFlowLogger`: Lightning's, writing through fittrain's `WandBTracker` and
`MLflowTracker` (their packages are optional: `pip install fittrain[wandb]`, `fittrain[mlflow]`).

The run is opened on first use of `experiment` (the Trainer touches it when a stage is set up, as
Lightning does), on the main process only; elsewhere `experiment` absorbs every call. Uploading
checkpoints as artifacts (`log_model`) is not supported: it is refused when the logger is built.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fittrain.common.reprs import short_repr
from fittrain.lightning.loggers.base import Logger, flat_numbers, is_main_process, plain_params
from fittrain.trackers.base import NoOpTracker
from fittrain.trackers.external import MLflowTracker, WandBTracker


def _refuse(owner: str, argument: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"`{owner}({argument}={short_repr(value)})` is not supported by fittrain.lightning. Instead: "
                      f"{fix}.")


class WandbLogger(Logger):
    """Lightning's `WandbLogger`: `wandb.init(name=, project=, dir=save_dir, id=version, ...)` on first use.

    Args:
        name: The run's display name.
        save_dir: Where wandb writes ("." by default); `dir` is the same.
        version: The run id (to resume a run); `id` is the same.
        offline: Run offline (`wandb sync` uploads later).
        anonymous: wandb's anonymous mode.
        project: The project (default: $WANDB_PROJECT, else "lightning_logs").
        log_model: Only False.
        experiment: Only None.
        prefix: Put before every metric name, joined with "-".
        checkpoint_name: Only None (it names uploaded checkpoints).
        **kwargs: Passed to `wandb.init` (entity, group, tags, ...).

    Raises:
        ValueError: for log_model, experiment or checkpoint_name.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, name: str | None = None, save_dir: Any = ".", version: str | None = None,
                 offline: bool = False, dir: Any = None, id: str | None = None, anonymous: bool | None = None,
                 project: str | None = None, log_model: bool | str = False, experiment: Any = None,
                 prefix: str = "", checkpoint_name: str | None = None, add_file_policy: str = "mutable",
                 **kwargs: Any) -> None:
        for argument, value, fix in (("log_model", log_model, "upload checkpoints with wandb.Artifact yourself"),
                                     ("experiment", experiment, "let the logger open the run (pass its id as "
                                                                "version= to continue it)"),
                                     ("checkpoint_name", checkpoint_name, "it names uploaded checkpoints, which "
                                                                          "fittrain.lightning does not upload")):
            if value is not None and value is not False:
                raise _refuse("WandbLogger", argument, value, fix)
        folder = save_dir if save_dir is not None else dir
        self._project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        self._save_dir = None if folder is None else os.fspath(folder)
        self._name, self._id = name, version or id
        self._prefix = prefix
        self._init = {"name": name, "dir": self._save_dir, "id": self._id, "resume": "allow",
                      "anonymous": "allow" if anonymous else None, **kwargs}
        if offline:
            self._init["mode"] = "offline"
        self._tracker: WandBTracker | None = None

    @property
    def experiment(self) -> Any:
        """The `wandb.Run` (an object absorbing every call on other processes)."""
        if not is_main_process():
            return NoOpTracker("wandb")
        if self._tracker is None:
            if self._save_dir is not None:
                os.makedirs(self._save_dir, exist_ok=True)
            self._tracker = WandBTracker(self._project, **{k: v for k, v in self._init.items() if v is not None})
            run = self._tracker.run
            if getattr(run, "define_metric", None):  # Lightning's x-axis: the trainer's step
                run.define_metric("trainer/global_step")
                run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._tracker.run

    @property
    def name(self) -> str:
        return self._project

    @property
    def version(self) -> str | None:
        return self._tracker.run.id if self._tracker is not None else self._id

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if not is_main_process():
            return
        values = flat_numbers(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        self.experiment.log(values if step is None else {**values, "trainer/global_step": step})

    def log_hyperparams(self, params: Any) -> None:
        if is_main_process():
            self.experiment.config.update(plain_params(params), allow_val_change=True)

    def watch(self, model: Any, log: str | None = "gradients", log_freq: int = 100, log_graph: bool = True) -> None:
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    def finalize(self, status: str) -> None:
        """Leaves the run open, as Lightning does (wandb finishes it at exit)."""


class MLFlowLogger(Logger):
    """Lightning's `MLFlowLogger`: an MLflow run in `experiment_name`, through an `MlflowClient`.

    Args:
        experiment_name: The experiment ("lightning_logs"); created when missing.
        run_name: The new run's name.
        tracking_uri: Where MLflow stores runs (default: $MLFLOW_TRACKING_URI, else `file:{save_dir}`).
        tags: Tags of a new run.
        save_dir: The local folder for a `file:` tracking URI ("./mlruns").
        log_model: Only False.
        prefix: Put before every metric name, joined with "-".
        artifact_location: Only None.
        run_id: Continue this run.
        synchronous: Only None.

    Raises:
        ValueError: for log_model, artifact_location or synchronous.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, Any] | None = None,
                 save_dir: str | None = "./mlruns", log_model: bool | str = False, prefix: str = "",
                 artifact_location: str | None = None, run_id: str | None = None,
                 synchronous: bool | None = None) -> None:
        for argument, value, fix in (("log_model", log_model, "log checkpoints with mlflow yourself"),
                                     ("artifact_location", artifact_location, "set it on the experiment in MLflow"),
                                     ("synchronous", synchronous, "metrics are logged synchronously")):
            if value is not None and value is not False:
                raise _refuse("MLFlowLogger", argument, value, fix)
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"file:{save_dir}"
        self._experiment_name, self._run_name, self._run_id = experiment_name, run_name, run_id
        self._tracking_uri, self.tags, self._prefix = tracking_uri, tags, prefix
        self._tracker: MLflowTracker | None = None

    def _open(self) -> MLflowTracker:
        if self._tracker is None:
            self._tracker = MLflowTracker(self._experiment_name, logging_dir=self._tracking_uri, run_id=self._run_id,
                                          tags=self.tags, run_name=self._run_name)
            self._run_id = self._tracker.run_id
        return self._tracker

    @property
    def experiment(self) -> Any:
        """The `MlflowClient` (an object absorbing every call on other processes)."""
        return self._open().client if is_main_process() else NoOpTracker("mlflow")

    @property
    def run_id(self) -> str | None:
        if is_main_process():
            self._open()
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        return self._open().client.get_run(self.run_id).info.experiment_id if is_main_process() else None

    @property
    def name(self) -> str | None:
        return self.experiment_id

    @property
    def version(self) -> str | None:
        return self.run_id

    @property
    def save_dir(self) -> str | None:
        uri = self._tracking_uri
        return uri[len("file:"):] if uri.startswith("file:") else None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if not is_main_process():
            return
        values = {re.sub("[^a-zA-Z0-9_/. -]+", "", name): value
                  for name, value in flat_numbers(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items()
                  if not isinstance(value, str)}
        self._open().log_scalars({name: float(value) for name, value in values.items()}, step or 0)

    def log_hyperparams(self, params: Any) -> None:
        if is_main_process():
            self._open().store_init_configuration(plain_params(params))

    def finalize(self, status: str = "success") -> None:
        if self._tracker is None or not is_main_process():
            return
        self._tracker.client.set_terminated(self._run_id, "FAILED" if status == "failed" else "FINISHED")
