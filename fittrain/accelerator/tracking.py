"""`Tracking`: the Accelerator's experiment trackers (Accelerate's `init_trackers`, `log`, `get_tracker`, `trackers`).

The Accelerator owns one and delegates those methods to it. The trackers themselves are
`fittrain.trackers` (its package docstring shows them). Only the main process opens trackers;
the others hold `NoOpTracker`s, so the same calls run everywhere and cost nothing there.
"""

from __future__ import annotations

import numbers
from typing import Any

from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.common.reprs import short_repr
from fittrain.trackers.base import NoOpTracker
from fittrain.trackers.registry import TrackerSpec, check_kwargs, missing_logging_dir, open_trackers


class Tracking:
    """The trackers of one Accelerator: opened by `init_trackers`, written by `log`.

    Args:
        log_with: The resolved `Accelerator(log_with=...)`: built-in tracker classes and tracker instances.
        project_configuration: Where file trackers write (its `logging_dir`).
        is_main_process: Whether this process opens real trackers (the others get `NoOpTracker`s).
    """

    def __init__(self, log_with: list[TrackerSpec], project_configuration: ProjectConfiguration,
                 is_main_process: bool) -> None:
        self.log_with = log_with
        self.project_configuration = project_configuration
        self.is_main_process = is_main_process
        self._trackers: tuple[Any, ...] = ()  # set by init_trackers

    @property
    def trackers(self) -> list[Any]:
        """The trackers `init_trackers` opened (NoOpTrackers on processes other than the main one)."""
        return list(self._trackers)

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Opens the `log_with` trackers for a run and records `config` as its hyperparameters.

        File trackers write to `{logging_dir}/{project_name}`; wandb takes `project_name` as its
        project, mlflow as its experiment. Calling it again finishes the open trackers first.

        Args:
            project_name: The run's name (a folder name for the file trackers).
            config: Hyperparameters, given to each tracker's `store_init_configuration`.
            init_kwargs: Keyword arguments per tracker name, e.g. `{"wandb": {"entity": "team"}}`.

        Raises:
            ValueError: when a tracker that writes files has no logging folder, or `init_kwargs`
                names a tracker not in `log_with`.
            TypeError: for a `project_name` that is not a non-empty string, or a `config` that is not a dict.
        """
        if not isinstance(project_name, str) or not project_name:
            raise TypeError(f"`init_trackers(project_name=...)` must be a non-empty string. Received: "
                            f"project_name={short_repr(project_name)}.")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"`init_trackers(config=...)` must be a dict of hyperparameters or None. Received: "
                            f"config={short_repr(config)} ({type(config).__name__}).")
        kwargs = check_kwargs(init_kwargs, self.log_with, "init_kwargs")
        logging_dir = self.project_configuration.logging_dir
        missing = missing_logging_dir(self.log_with, "init_trackers()") if logging_dir is None else None
        if missing is not None:
            raise missing
        self.finish()

        def build(cls: Any, options: dict[str, Any]) -> Any:
            if cls.requires_logging_directory:
                return cls(project_name, logging_dir, **options)
            return cls(project_name, **options)

        self._trackers = tuple(open_trackers(self.log_with, self.is_main_process, build, kwargs))
        if config is not None:
            for tracker in self._trackers:
                tracker.store_init_configuration(config)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Logs `values` to every tracker (on the main process; elsewhere the trackers do nothing).

        Args:
            values: Metric names to numbers (strings and nested dicts where a tracker takes them).
            step: The step to log at; None lets each tracker count (its last step plus one).
            log_kwargs: Keyword arguments per tracker name, e.g. `{"wandb": {"commit": False}}`.

        Raises:
            ValueError: for a `step` that is not an int >= 0 (checked on every process alike).
        """
        step = _check_step(step)
        kwargs = check_kwargs(log_kwargs, self._trackers, "log_kwargs") if log_kwargs else {}
        for tracker in self._trackers:
            tracker.log(values, step=step, **kwargs.get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (with `unwrap`, its underlying object: a SummaryWriter, a wandb run).

        On processes other than the main one this is a `NoOpTracker`, whose every call does nothing.

        Raises:
            ValueError: when no open tracker has that name.
        """
        for tracker in self._trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self._trackers:
            raise ValueError(f"get_tracker({name!r}): no tracker is open. Pass Accelerator(log_with=[...]) and call "
                             "accelerator.init_trackers(project_name) first.")
        names = [tracker.name for tracker in self._trackers]
        raise ValueError(f"get_tracker({name!r}): no open tracker has that name. Received: name={name!r}. Open "
                         f"trackers: {names}.")

    def finish(self) -> None:
        """Finishes every open tracker (end_training and a second init_trackers call it)."""
        trackers, self._trackers = self._trackers, ()
        for tracker in trackers:
            if not isinstance(tracker, NoOpTracker):
                tracker.finish()


def _check_step(step: Any) -> int | None:
    """`log(step=...)` as an int (numpy's integers too), or None; a step is a count, never negative."""
    if step is None or isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0:
        return None if step is None else int(step)
    raise ValueError(f"`log(step=...)` must be an int >= 0 or None. Received: step={short_repr(step)} "
                     f"({type(step).__name__}). Pass the step count, e.g. accelerator.log(values, "
                     "step=completed_steps), or leave step out so each tracker counts on from its last step.")
