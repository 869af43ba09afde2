"""`TensorBoardLogger` and `CSVLogger`: Lightning's file loggers, in Lightning's layout
(`{save_dir}/{name}/version_{n}/` with `hparams.yaml`).

TensorBoard writes through fittrain's `TensorBoardTracker` (one event per logging point; its
`tracker`, a torch `SummaryWriter` on the same folder, is `experiment`). The CSV file is
Lightning's wide one (a column per metric, plus `epoch` and `step`, a row per logging point), not
the native CSVTracker's long one (`step,name,value,wall_time`), because Lightning programs read it
back by column (`pd.read_csv(f"{logger.log_dir}/metrics.csv")["val_loss"]`).
"""

from __future__ import annotations

import csv
import os
from typing import Any

from fittrain.lightning.loggers.base import (
    Logger,
    VersionedFolder,
    flat_numbers,
    is_main_process,
    plain_params,
    write_hparams_yaml,
)
from fittrain.trackers.base import NoOpTracker
from fittrain.trackers.tensorboard import TensorBoardTracker

HPARAMS_FILE = "hparams.yaml"


class _FileLogger(Logger):
    """A logger writing into a versioned folder on the main process; `hparams.yaml` beside its files."""

    def __init__(self, save_dir: Any, name: str | None, version: int | str | None, prefix: str) -> None:
        self._folder = VersionedFolder(save_dir, name, version, type(self).__name__)
        self._prefix = prefix
        self.hparams: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self._folder.name

    @property
    def version(self) -> int | str:
        return self._folder.version

    @property
    def save_dir(self) -> str:
        return self._folder.save_dir

    @property
    def root_dir(self) -> str:
        return self._folder.root_dir

    @property
    def log_dir(self) -> str:
        return self._folder.log_dir

    def _settle_version(self, version: int | str) -> None:
        """Takes the version the main process chose (the Trainer broadcasts it when a fit starts)."""
        self._folder.settle(version)

    def _write_hparams_file(self) -> None:
        if is_main_process() and os.path.isdir(self.log_dir) and not os.path.isfile(os.path.join(self.log_dir,
                                                                                                  HPARAMS_FILE)):
            write_hparams_yaml(os.path.join(self.log_dir, HPARAMS_FILE), self.hparams)


class TensorBoardLogger(_FileLogger):
    """Lightning's `TensorBoardLogger`: event files in `{save_dir}/{name}/version_{n}`.

    Args:
        save_dir: The folder holding the experiments.
        name: The experiment's folder ("lightning_logs").
        version: An int, a str (the folder's name) or None (the next free `version_{n}`).
        log_graph: Lightning's graph logging; refused (use `logger.experiment.add_graph(model, x)`).
        default_hp_metric: Write `hp_metric` = -1 at step 0 with the hyperparameters, as Lightning does.
        prefix: Put before every metric name, joined with "-".
        sub_dir: A folder inside the version's, for the event files.
        **kwargs: Passed to the `SummaryWriter` that `experiment` opens.

    Raises:
        ValueError: for `log_graph=True`.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: Any, name: str | None = "lightning_logs", version: int | str | None = None,
                 log_graph: bool = False, default_hp_metric: bool = True, prefix: str = "", sub_dir: Any = None,
                 **kwargs: Any) -> None:
        if log_graph:
            raise ValueError("TensorBoardLogger(log_graph=True) is not supported by fittrain.lightning. Write the "
                             "graph yourself: trainer.logger.experiment.add_graph(model, example_input).")
        super().__init__(save_dir, name, version, prefix)
        self._default_hp_metric = default_hp_metric
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._tracker: TensorBoardTracker | None = None

    @property
    def log_dir(self) -> str:
        folder = super().log_dir
        return os.path.expanduser(os.path.expandvars(os.path.join(folder, self._sub_dir) if self._sub_dir else folder))

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    def _events(self) -> Any:
        """fittrain's TensorBoardTracker on `log_dir`, opened on first use; a NoOpTracker on other processes."""
        if self._tracker is None:
            if not is_main_process():
                return NoOpTracker("tensorboard")
            parent, folder = os.path.split(self.log_dir)
            self._tracker = TensorBoardTracker(folder, parent, **self._kwargs)
        return self._tracker

    @property
    def experiment(self) -> Any:
        """A torch `SummaryWriter` on `log_dir` (an object that absorbs every call on other processes)."""
        return self._events().tracker

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Writes `metrics` as scalars at `step` (one event)."""
        if not is_main_process():
            return
        self._events().log_scalars(flat_numbers(metrics, self._prefix, self.LOGGER_JOIN_CHAR),
                                   0 if step is None else int(step))

    def log_hyperparams(self, params: Any, metrics: dict[str, Any] | None = None, step: int | None = None) -> None:
        """Records `params` (TensorBoard's HPARAMS tab, and `hparams.yaml`) with `hp_metric`."""
        params = plain_params(params)
        self.hparams.update(params)
        if not is_main_process():
            return
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        elif metrics is not None and not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if metrics:
            self.log_metrics(metrics, 0 if step is None else step)
            self._events().store_init_configuration(params)

    def save(self) -> None:
        """Flushes the event file and writes `hparams.yaml` if it is not there yet."""
        if self._tracker is not None:
            self._tracker.flush()
        self._write_hparams_file()

    def finalize(self, status: str) -> None:
        """Closes the event file (a later write opens it again); writes `hparams.yaml` on success."""
        if status == "success":
            self.save()
        if self._tracker is not None:
            self._tracker.finish()
            self._tracker = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger(save_dir={self.save_dir!r}, name={self.name!r}, version={self._folder._version!r})"


class CSVLogger(_FileLogger):
    """Lightning's `CSVLogger`: `metrics.csv` (a column per metric, `epoch`, `step`; a row per
    logging point) and `hparams.yaml` in `{save_dir}/{name}/version_{n}`.

    Args:
        save_dir: The folder holding the experiments.
        name: The experiment's folder ("lightning_logs").
        version: An int, a str (the folder's name) or None (the next free `version_{n}`).
        prefix: Put before every metric name, joined with "-".
        flush_logs_every_n_steps: Write the file when a row's `step + 1` is a multiple of this (the
            Trainer also writes it after each of its rows, as Lightning's does).
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: Any, name: str | None = "lightning_logs", version: int | str | None = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(save_dir, name, version, prefix)
        self._flush_every = flush_logs_every_n_steps
        self._experiment: ExperimentWriter | None = None

    @property
    def experiment(self) -> "ExperimentWriter":
        """The writer of `metrics.csv` and `hparams.yaml` (Lightning's `ExperimentWriter`)."""
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir, self.hparams)
        return self._experiment

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Adds a row; writes the file every `flush_logs_every_n_steps` steps."""
        if not is_main_process():
            return
        self.experiment.log_metrics(flat_numbers(metrics, self._prefix, self.LOGGER_JOIN_CHAR), step)
        if step is not None and (step + 1) % self._flush_every == 0:
            self.save()

    def log_hyperparams(self, params: Any = None) -> None:
        """Records `params` for `hparams.yaml`."""
        self.hparams.update(plain_params(params))

    def save(self) -> None:
        """Writes the rows so far and `hparams.yaml`."""
        if is_main_process():
            self.experiment.save()

    def __repr__(self) -> str:
        return f"CSVLogger(save_dir={self.save_dir!r}, name={self.name!r}, version={self._folder._version!r})"


class ExperimentWriter:
    """Lightning's CSV experiment writer: rows kept in memory, written with a sorted header of every
    key seen (the file is rewritten when a new key appears).

    Args:
        log_dir: The folder of `metrics.csv` and `hparams.yaml`.
        hparams: The logger's hyperparameters (shared, so later updates are written).
    """

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = HPARAMS_FILE

    def __init__(self, log_dir: str, hparams: dict[str, Any]) -> None:
        self.log_dir = log_dir
        self.hparams = hparams
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._written: list[dict[str, Any]] = []
        os.makedirs(log_dir, exist_ok=True)
        if os.path.isfile(self.metrics_file_path):  # Lightning's too: a version folder given again starts over
            os.remove(self.metrics_file_path)

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        """Adds a row (`step`: the row's number when None)."""
        row = {name: (value.item() if hasattr(value, "item") else value) for name, value in metrics_dict.items()}
        row["step"] = len(self.metrics) + len(self._written) if step is None else step
        self.metrics.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Records hyperparameters for `hparams.yaml`."""
        self.hparams.update(params)

    def save(self) -> None:
        """Writes `hparams.yaml` and the rows added since the last save."""
        write_hparams_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
        if not self.metrics:
            return
        keys = set(self.metrics_keys).union(*self.metrics)
        rewrite = len(keys) != len(self.metrics_keys) and os.path.isfile(self.metrics_file_path)
        self.metrics_keys = sorted(keys)
        rows, mode = (self._written + self.metrics, "w") if rewrite or not os.path.isfile(
            self.metrics_file_path) else (self.metrics, "a")
        with open(self.metrics_file_path, mode, newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)
        self._written.extend(self.metrics)
        self.metrics = []
