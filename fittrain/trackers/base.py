"""The tracker base class (Accelerate's `GeneralTracker`), the stand-in other processes get, and
the value checks every built-in tracker shares."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Iterator, Mapping

from fittrain.common.reprs import short_repr


class GeneralTracker:
    """An experiment tracker: where `Accelerator.log` and the `Logger` callback write.

    The shape is Accelerate's, so a tracker written for Accelerate works here: a `name`, whether
    it `requires_logging_directory`, a `tracker` property returning the underlying object (a
    writer, a wandb run), `store_init_configuration(values)` for hyperparameters, `log(values,
    step)` and `finish()`. `flush()` (push buffered values to disk) and `for_run` (how the
    Logger opens one per run) are fittrain's additions, with defaults that fit most trackers.

    Attributes:
        name: The tracker's name, as used in `log_with`, `init_kwargs` and `get_tracker`.
        requires_logging_directory: Whether `init_trackers` passes the Accelerator's
            `logging_dir` as the second argument.
        main_process_only: Whether only the main process runs it (others get a `NoOpTracker`).

    Example:
        >>> class PrintTracker(GeneralTracker):
        ...     name, requires_logging_directory = "print", False
        ...     @property
        ...     def tracker(self): return None
        ...     def log(self, values, step=None, **kwargs): print(step, values)
        >>> Accelerator(log_with=[PrintTracker(), "csv"], project_dir="runs/a")
    """

    name: str = "general"
    requires_logging_directory: bool = False
    main_process_only: bool = True

    @property
    def tracker(self) -> Any:
        """The underlying object (what `get_tracker(name, unwrap=True)` returns)."""
        return None

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Records the run's hyperparameters (called once, when the run starts)."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Records `values` (name -> number) at `step`."""

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        """The Logger's call: floats by name at `step`. Built-ins skip `log`'s checks here."""
        self.log(scalars, step=step)

    def flush(self) -> None:
        """Pushes buffered values to disk (the Logger calls it after each validation)."""

    def finish(self) -> None:
        """Closes the run; later calls do nothing."""

    @classmethod
    def for_run(cls, run: "RunInfo", **kwargs: Any) -> "GeneralTracker":
        """Opens this tracker for one of the Logger's runs, in `run.folder` or under `run.name`.

        Override to map the run onto the backend's own notion of a run (wandb's `id`, mlflow's
        `run_name`); `kwargs` are the user's `init_kwargs` for this tracker.
        """
        if cls.requires_logging_directory:
            return cls(run.name, run.logs_dir, **kwargs)  # type: ignore[call-arg]
        return cls(run.project, **kwargs)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One Logger run: `{logs_dir}/{name}` is its folder.

    Attributes:
        logs_dir: The folder that holds every run's folder.
        name: The run's name (its folder's name).
        project: The project name for trackers that group runs by project (wandb, mlflow).
        purge_step: For a resumed run, the first step the resumed run writes again: points the
            interrupted run wrote from there on are replaced. None for a new run.
    """

    logs_dir: str
    name: str
    project: str
    purge_step: int | None = None

    @property
    def folder(self) -> str:
        """The run's own folder."""
        return os.path.join(self.logs_dir, self.name)


class NoOpTracker(GeneralTracker):
    """What processes other than the main one hold instead of a main-process-only tracker.

    Every method does nothing, so code runs unchanged on every process: even calls on the
    unwrapped object (`get_tracker("tensorboard", unwrap=True).add_histogram(...)`) are absorbed,
    as any public attribute is this object again and calling it returns None.

    Args:
        name: The name of the tracker it stands for.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def tracker(self) -> "NoOpTracker":
        return self

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):  # keep copy/pickle protocols and typos in private names honest
            raise AttributeError(attribute)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"NoOpTracker(name={self.name!r})"


def as_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (bool, int, float, numpy or 0-d/1-element
    tensor), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1:  # a tensor: one device sync
        return float(value.item())
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy array or scalar
        return float(value.item())
    return None


def flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of a nested dict, nested names joined with "/" (TensorBoard's groups)."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}/")
        else:
            yield name, value


def check_values(values: Any, tracker: str) -> None:
    """Refuses `log` values that are not a dict with string keys."""
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise TypeError(f"`{tracker}.log(values=...)` takes a dict of metric names (str) to numbers. "
                        f"Received: values={short_repr(values)} ({type(values).__name__}). "
                        "Pass e.g. {'train_loss': 0.25}.")


def unloggable(tracker: str, name: str, value: Any) -> TypeError:
    """The error for a value a tracker cannot record."""
    return TypeError(f"`{tracker}.log` cannot record {name!r}: its value is a {type(value).__name__} "
                     f"({short_repr(value)}). Log numbers (int, float, a one-element tensor), strings, or dicts "
                     "of them.")


def hparam_value(value: Any) -> bool | int | float | str:
    """A hyperparameter as a bool, int, float or str (anything else as its short repr)."""
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    number = as_number(value) if not isinstance(value, (list, tuple)) else None
    return number if number is not None else short_repr(value, 200)


def hparams_of(values: Any, tracker: str) -> dict[str, bool | int | float | str]:
    """`store_init_configuration`'s values, flattened, as bool/int/float/str only.

    Raises:
        TypeError: when `values` is not a dict.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"`{tracker}.store_init_configuration(values=...)` takes a dict of hyperparameters. "
                        f"Received: values={short_repr(values)} ({type(values).__name__}). "
                        "Pass e.g. {'lr': 0.01, 'batch_size': 32}.")
    return {str(name): hparam_value(value) for name, value in flatten(values)}
