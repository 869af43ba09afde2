"""`log_with` resolution (names, `LoggerType`, instances, "all") and opening trackers on the right
processes."""

from __future__ import annotations

import enum
import importlib.util
from typing import Any, Callable, Sequence

from fittrain.common.reprs import short_repr
from fittrain.trackers.base import GeneralTracker, NoOpTracker
from fittrain.trackers.external import PACKAGES, MLflowTracker, WandBTracker, import_package
from fittrain.trackers.files import CSVTracker, JSONLTracker
from fittrain.trackers.tensorboard import TensorBoardTracker


class LoggerType(str, enum.Enum):
    """The built-in trackers' names, as Accelerate's `LoggerType` (a str: "tensorboard" == LoggerType.TENSORBOARD)."""

    ALL = "all"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"
    CSV = "csv"
    JSONL = "jsonl"

    def __str__(self) -> str:
        return self.value


BUILT_IN: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandBTracker, "mlflow": MLflowTracker,
    "csv": CSVTracker, "jsonl": JSONLTracker,
}
#: The Python module each built-in needs to run; "all" takes the built-ins whose module is installed.
_NEEDS = {"tensorboard": "tensorboard", **{name: module for name, (module, _) in PACKAGES.items()}}
#: What "all" may open: Accelerate's integrations that fittrain has. Accelerate has no csv or jsonl
#: tracker, so a script moved from it with log_with="all" gets no files it did not ask for.
_ALL = ("tensorboard", "wandb", "mlflow")

#: A resolved `log_with` entry: a built-in's class (opened by `init_trackers`) or a ready tracker.
TrackerSpec = Any


def is_tracker(obj: Any) -> bool:
    """Whether `obj` is a tracker instance: a GeneralTracker, or anything shaped like one
    (Accelerate's trackers: name, log, store_init_configuration, finish)."""
    if isinstance(obj, GeneralTracker):
        return True
    return not isinstance(obj, type) and isinstance(getattr(obj, "name", None), str) and all(
        callable(getattr(obj, m, None)) for m in ("log", "store_init_configuration", "finish"))


def is_available(name: str) -> bool:
    """Whether the package the built-in tracker `name` needs is installed (nothing is imported)."""
    module = _NEEDS.get(name)
    return module is None or importlib.util.find_spec(module) is not None


def resolve_trackers(log_with: Any, argument: str = "log_with") -> list[TrackerSpec]:
    """`log_with` as a list of built-in tracker classes and tracker instances, without duplicates.

    Accepts None, "all", a built-in's name, a `LoggerType`, a tracker instance, or a list of these.
    "all" means Accelerate's trackers (tensorboard, wandb, mlflow) whose package is installed;
    fittrain's own csv and jsonl are opened only when named.

    Raises:
        ValueError: for an unknown name, naming the accepted ones.
        TypeError: for anything else.
        ImportError: for a built-in named explicitly whose package is missing (naming the pip extra).
    """
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    specs: list[TrackerSpec] = []
    for item in items:
        for spec in _resolve_one(item, argument):
            if spec not in specs:
                specs.append(spec)
    return specs


def _resolve_one(item: Any, argument: str) -> list[TrackerSpec]:
    if is_tracker(item):
        return [item]
    if not isinstance(item, str):
        raise TypeError(f"`{argument}` takes tracker names, LoggerType members or tracker instances. Received: "
                        f"{short_repr(item)} ({type(item).__name__}). Pass e.g. log_with=['tensorboard', 'csv'], or "
                        "an instance of a fittrain.trackers.GeneralTracker subclass.")
    name = str(item).lower()
    if name == LoggerType.ALL.value:
        return [BUILT_IN[key] for key in _ALL if is_available(key)]
    if name not in BUILT_IN:
        accepted = ", ".join(repr(t.value) for t in LoggerType)
        raise ValueError(f"`{argument}` names an unknown tracker. Received: {item!r}. Accepted: {accepted}, a "
                         "LoggerType member, or a tracker instance.")
    if not is_available(name):
        import_package(name)  # raises the ImportError that names the extra
    return [BUILT_IN[name]]


def check_kwargs(kwargs: Any, specs: Sequence[TrackerSpec], argument: str) -> dict[str, dict[str, Any]]:
    """Checks per-tracker keyword arguments ({"wandb": {...}}): a dict of dicts keyed by tracker names.

    Raises:
        TypeError: for anything that is not a dict of dicts.
        ValueError: for a key that names no tracker in use (a typo would be ignored silently).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise TypeError(f"`{argument}` must map tracker names to dicts of keyword arguments. Received: "
                        f"{argument}={short_repr(kwargs)}. Pass e.g. {argument}={{'wandb': {{'entity': 'my-team'}}}}.")
    names = [spec.name for spec in specs]
    unknown = sorted(str(k) for k in kwargs if str(k) not in names)
    if unknown:
        raise ValueError(f"`{argument}` has keys that name no tracker in use: {unknown}. Trackers in use: {names}. "
                         "Key each dict by a tracker's name, as in log_with.")
    return {str(k): v for k, v in kwargs.items()}


def open_trackers(specs: Sequence[TrackerSpec], is_main_process: bool,
                  build: Callable[[type[GeneralTracker], dict[str, Any]], Any],
                  kwargs: dict[str, dict[str, Any]]) -> list[Any]:
    """Opens each spec on this process: `build(cls, its kwargs)` for a built-in, the instance itself
    for a ready tracker; a `NoOpTracker` instead of a main-process-only tracker elsewhere."""
    trackers = []
    for spec in specs:
        if not is_main_process and getattr(spec, "main_process_only", True):
            trackers.append(NoOpTracker(spec.name))
        elif isinstance(spec, type):
            trackers.append(build(spec, kwargs.get(spec.name, {})))
        else:
            trackers.append(spec)
    return trackers


def missing_logging_dir(specs: Sequence[TrackerSpec], method: str) -> ValueError | None:
    """The error for built-ins that write files when there is no logging folder, or None."""
    needing = [spec.name for spec in specs if isinstance(spec, type) and spec.requires_logging_directory]
    if not needing:
        return None
    return ValueError(f"{method} needs a logging folder for {', '.join(needing)}, and this Accelerator has none. "
                      "Pass Accelerator(project_dir='runs/my-run') (init_trackers('exp') then writes runs/my-run/exp), "
                      "or project_config=ProjectConfiguration(project_dir=..., logging_dir=...).")
