"""WandBTracker and MLflowTracker: trackers whose package is an optional extra, imported only when
one is opened (`pip install fittrain[wandb]`, `pip install fittrain[mlflow]`)."""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

from fittrain.trackers.base import GeneralTracker, RunInfo, as_number, check_values, flatten, hparams_of

#: The pip package each tracker needs, and the fittrain extra that installs it.
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
#: mlflow refuses longer parameter values.
MLFLOW_PARAM_LIMIT = 6000


def import_package(tracker: str) -> Any:
    """Imports the package `tracker` needs.

    Raises:
        ImportError: naming the pip extra that installs it.
    """
    module, extra = PACKAGES[tracker]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"log_with={tracker!r} needs the {module!r} package, which is not installed. Install it "
                          f"with `pip install fittrain[{extra}]` (or `pip install {err.name or module}`), or "
                          f"remove {tracker!r} from log_with.") from err


class WandBTracker(GeneralTracker):
    """Logs to Weights & Biases: `wandb.init(project=run_name, **kwargs)`, as Accelerate does.

    Set `WANDB_MODE=offline` to write the run under `dir` (or `WANDB_DIR`) without a network;
    `wandb sync` uploads it later.

    Args:
        run_name: The wandb project.
        **kwargs: Passed to `wandb.init` (name, id, dir, tags, mode, ...).
    """

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        wandb = import_package("wandb")
        self.run: Any = wandb.init(project=run_name, **kwargs)

    @classmethod
    def for_run(cls, run: RunInfo, **kwargs: Any) -> "WandBTracker":
        """One wandb run per Logger run: its `id` is the run name, so a resumed run continues it."""
        os.makedirs(run.folder, exist_ok=True)
        defaults = {"name": run.name, "id": run.name, "resume": "allow", "dir": run.folder}
        return cls(run.project, **{**defaults, **kwargs})

    @property
    def tracker(self) -> Any:
        """The `wandb.Run`."""
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(hparams_of(values, "WandBTracker"), allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """`run.log(values, step=step, **kwargs)`."""
        check_values(values, "WandBTracker")
        self.run.log(values, step=step, **kwargs)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowTracker(GeneralTracker):
    """Logs to MLflow through an `MlflowClient` (no global active run, so two Accelerators never share one).

    Args:
        experiment_name: The experiment; created when missing.
        logging_dir: The tracking URI (e.g. "file:///tmp/mlruns", "http://host:5000"); default:
            mlflow's (`MLFLOW_TRACKING_URI`, else ./mlruns).
        run_id: Continue this run instead of starting one.
        tags: Tags of a new run.
        run_name: The new run's name.
        resume: With `run_name`, continue the newest run of that name in the experiment, if any.
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str, logging_dir: str | os.PathLike | None = None, run_id: str | None = None,
                 tags: dict[str, Any] | None = None, run_name: str | None = None, resume: bool = False) -> None:
        import_package("mlflow")  # names the extra to install when mlflow is missing
        from mlflow.tracking import MlflowClient  # an optional extra: imported only for this tracker

        self.client = MlflowClient(tracking_uri=None if logging_dir is None else os.fspath(logging_dir))
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        if run_id is None and resume and run_name:
            found = self.client.search_runs([experiment_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'",
                                            order_by=["attributes.start_time DESC"], max_results=1)
            run_id = found[0].info.run_id if found else None
        if run_id is None:
            run_id = self.client.create_run(experiment_id, run_name=run_name,
                                            tags={str(k): str(v) for k, v in (tags or {}).items()}).info.run_id
        self.run_id: str | None = run_id

    @classmethod
    def for_run(cls, run: RunInfo, **kwargs: Any) -> "MLflowTracker":
        """One mlflow run per Logger run, named like it; a resumed run continues it."""
        defaults = {"run_name": run.name, "resume": run.purge_step is not None}
        return cls(run.project, **{**defaults, **kwargs})

    @property
    def tracker(self) -> Any:
        """The mlflow `Run` (its `info.run_id`, `data`); log more with `self.client`."""
        return self.client.get_run(self.run_id)

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param  # an optional extra, as in __init__

        hparams = hparams_of(values, "MLflowTracker")
        params = [Param(name, str(value)[:MLFLOW_PARAM_LIMIT]) for name, value in hparams.items()]
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Logs the numbers among `values` (nested names joined with "/") at `step`."""
        check_values(values, "MLflowTracker")
        numbers = {name: number for name, value in flatten(values) if (number := as_number(value)) is not None}
        self.log_scalars(numbers, 0 if step is None else int(step))

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # an optional extra, as in __init__

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in scalars.items()])

    def finish(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
