"""The Lightning logger base class and what the file loggers share: versioned run folders
(`{save_dir}/{name}/version_{n}`), `hparams.yaml`, and writing on the main process only."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable

from fittrain.accelerator.process_logging import process_index
from fittrain.common.reprs import short_repr
from fittrain.trackers.base import NoOpTracker
from fittrain.trainer.hparams import recordable_value


def is_main_process() -> bool:
    """Whether this process writes logs: rank 0 of a job torchrun, `fittrain launch` or srun started,
    or a lone process (Lightning's loggers write on rank 0 only)."""
    return process_index() == 0


class Logger:
    """What every Lightning logger has (Lightning's `lightning.pytorch.loggers.Logger`).

    The Trainer calls `log_hyperparams` when a fit starts, `log_metrics(metrics, step)` at Lightning's
    logging points (fittrain/lightning/connector.py), `save()` after each, and `finalize("success")`
    when a stage ends. A subclass writes through a fittrain tracker or a file of its own.
    """

    @property
    def name(self) -> str | None:
        """The experiment's name."""
        return None

    @property
    def version(self) -> int | str | None:
        """The experiment's version."""
        return None

    @property
    def save_dir(self) -> str | None:
        """Where the logger writes (None for a remote one)."""
        return None

    @property
    def root_dir(self) -> str | None:
        """The folder holding every version of this experiment."""
        return None

    @property
    def log_dir(self) -> str | None:
        """This version's folder."""
        return None

    @property
    def experiment(self) -> Any:
        """The underlying writer."""
        return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Records `metrics` at `step`."""

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Records the hyperparameters."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """Records the model's graph (a no-op unless the logger supports it)."""

    def save(self) -> None:
        """Writes what is buffered."""

    def finalize(self, status: str) -> None:
        """Called when a stage ends ("success", "failed")."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called after a checkpoint was saved."""

    @property
    def group_separator(self) -> str:
        return "/"


def rank_zero_experiment(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Lightning's decorator for a custom logger's `experiment` property: on rank 0 what `fn` returns,
    on the other processes an object that takes any call and does nothing, so that
    `self.logger.experiment.add_image(...)` runs on every process and writes once.

    Example:
        >>> class PrintLogger(Logger):
        ...     @property
        ...     @rank_zero_experiment
        ...     def experiment(self):
        ...         return open("log.txt", "a")
    """

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        return fn(self) if is_main_process() else NoOpTracker("dummy")

    return experiment


class DummyLogger(Logger):
    """What the loggers become under `fast_dev_run` (Lightning's): every call does nothing, and
    `experiment` absorbs any call, so `self.logger.experiment.add_image(...)` still runs."""

    @property
    def experiment(self) -> Any:
        return NoOpTracker("dummy")

    def __getitem__(self, index: int) -> "DummyLogger":
        return self


class VersionedFolder:
    """`{save_dir}/{name}/version_{n}` (or `.../{version}` for a str), Lightning's file layout; the
    version, when not given, is the next free number, found on first use.

    Args:
        save_dir: The folder holding the experiments.
        name: The experiment's folder; "" or None puts the versions right in `save_dir`.
        version: An int (`version_{int}`), a str (the folder's name) or None (the next free number).
    """

    def __init__(self, save_dir: Any, name: str | None, version: int | str | None, owner: str) -> None:
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"`{owner}(save_dir=...)` must be a folder path. Received: "
                            f"save_dir={short_repr(save_dir)}.")
        if version is not None and not isinstance(version, (int, str)):
            raise TypeError(f"`{owner}(version=...)` must be an int, a str or None. Received: "
                            f"version={short_repr(version)}.")
        self.save_dir = os.fspath(save_dir)
        self.name = name or ""
        self._version = version

    @property
    def root_dir(self) -> str:
        return os.path.join(self.save_dir, self.name)

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.root_dir)
        return self._version

    def settle(self, version: int | str) -> None:
        """Takes the version the main process chose (the others may see other folders)."""
        self._version = version

    @property
    def log_dir(self) -> str:
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")


def next_version(root: str) -> int:
    """One more than the highest `version_{n}` folder in `root`; 0 when there is none."""
    try:
        entries = os.listdir(root)
    except OSError:
        return 0
    numbers = [int(entry[len("version_"):]) for entry in entries
               if entry.startswith("version_") and entry[len("version_"):].isdigit()
               and os.path.isdir(os.path.join(root, entry))]
    return max(numbers) + 1 if numbers else 0


def plain_params(params: Any) -> dict[str, Any]:
    """Hyperparameters as a dict: a dict, an argparse Namespace (its vars), or None ({})."""
    if params is None:
        return {}
    if isinstance(params, dict):
        return dict(params)
    if hasattr(params, "__dict__") and not callable(params):
        return dict(vars(params))
    raise TypeError(f"log_hyperparams(params) takes a dict or an argparse.Namespace. Received: {short_repr(params)} "
                    f"({type(params).__name__}).")


def write_hparams_yaml(path: str, hparams: dict[str, Any]) -> None:
    """Writes `hparams.yaml` as Lightning does (values YAML cannot hold are written as their repr).

    PyYAML is optional for fittrain: without it the file is written as JSON, which is valid YAML.
    """
    try:
        import yaml  # optional: only where a Lightning logger writes hparams.yaml
    except ImportError:
        yaml = None
    safe = {str(key): recordable_value(value) for key, value in hparams.items()}
    with open(path, "w", encoding="utf-8") as file:
        if yaml is not None:
            yaml.safe_dump(safe, file, sort_keys=True)  # Lightning's order
        else:
            json.dump(safe, file, indent=2, sort_keys=True)


def flat_numbers(metrics: dict[str, Any], prefix: str = "", separator: str = "-") -> dict[str, float]:
    """`metrics` as floats (tensors read once), with Lightning's `prefix` joined by `separator`."""
    values = {}
    for name, value in metrics.items():
        number = value.item() if hasattr(value, "item") else value
        values[f"{prefix}{separator}{name}" if prefix else name] = number
    return values
