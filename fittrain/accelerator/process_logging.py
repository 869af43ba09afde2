"""Logging on several processes: Accelerate's `get_logger`, with `main_process_only` and `in_order`.

`get_logger(name)` returns a `logging.LoggerAdapter` over the standard logger `name`. Each call
takes two more keywords: `main_process_only=True` (the default) logs on the main process only;
`in_order=True` logs on every process, one after another (rank 0 first), with a barrier after
each turn, so every process must make the call. Messages start with `[RANK i]`, as in
Accelerate 1.13 and newer.

Accelerate refuses to log before its process-wide state was set up (by `PartialState()` or an
`Accelerator`). fittrain has no such state to wait for: the rank comes from torchrun's (or SLURM's)
variables, or from the process group once one exists, so logging works from the first line of a
script, as users expect of a logger; only `in_order=True` joins the process group if it was not
joined yet (a barrier needs one).

Example:
    >>> logger = get_logger(__name__, log_level="INFO")
    >>> logger.info("starting")                                   # main process only
    >>> logger.info(accelerator.state, main_process_only=False)   # every process
    >>> logger.info(f"shard {rank}", in_order=True)               # every process, in rank order
"""

from __future__ import annotations

import logging
import os
from typing import Any, MutableMapping

import torch.distributed as dist

from fittrain.accelerator.partial_state import PartialState
from fittrain.common.reprs import short_repr

#: Accelerate's variable for the level of loggers made by `get_logger` without a `log_level`.
LOG_LEVEL_ENV = "ACCELERATE_LOG_LEVEL"
_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def process_index() -> int:
    """This process's global rank, without joining a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from fittrain.distributed.process_state import _launcher_facts  # torchrun's variables, else SLURM's

    return _launcher_facts()[1]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger adapter whose calls take `main_process_only=True` and `in_order=False`.

    `in_order=True` overrides `main_process_only`: every process logs, in rank order.
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefixes the rank, and points the record at the caller's line instead of this adapter's."""
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)
        return f"[RANK {process_index()}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Logs `msg` on the main process, on every process, or on every process in rank order.

        Args:
            level: The logging level.
            msg: The message (formatted with `args`, as by `logging`).
            main_process_only: Log on the main process only (default True).
            in_order: Log on every process, one after the other in rank order; every process must
                make the call, as it waits for the others at a barrier.
        """
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            self._log_in_order(level, msg, args, kwargs)
        elif not main_process_only or process_index() == 0:
            self.logger.log(level, msg, *args, **kwargs)

    def _log_in_order(self, level: int, msg: Any, args: tuple[Any, ...], kwargs: MutableMapping[str, Any]) -> None:
        kwargs["stacklevel"] = kwargs["stacklevel"] + 1  # this method is one more frame above the caller
        state = PartialState()  # joins the process group if the environment asks for one
        for turn in range(state.num_processes):
            if turn == state.process_index:
                self.logger.log(level, msg, *args, **kwargs)
                for handler in self.logger.handlers + logging.getLogger().handlers:
                    handler.flush()  # the next process writes only after this one's line is out
            state.wait_for_everyone()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning(...)`, once per distinct set of arguments on this logger (repeats are dropped)."""
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_warned", set())  # per adapter: no cache that outlives it
        if key in seen:
            return
        seen.add(key)
        kwargs.setdefault("stacklevel", 3)  # past this method too, to the caller's line
        self.warning(*args, **kwargs)


def _check_level(log_level: Any, source: str) -> str:
    """`log_level` as an upper-case level name; a clear error for anything else."""
    if isinstance(log_level, str) and log_level.strip().upper() in _LEVELS:
        return log_level.strip().upper()
    raise ValueError(f"{source} must be a logging level name: {', '.join(_LEVELS)} (any case). "
                     f"Received: {short_repr(log_level)}. Pass e.g. log_level='INFO'.")


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The standard logger `name`, wrapped so that each call decides which processes log.

    Args:
        name: The logger's name, usually `__name__`.
        log_level: A level name ("DEBUG", "INFO", ...) set on this logger and on the root logger;
            None: the ACCELERATE_LOG_LEVEL variable's, when set, else the levels stay as they are.

    Returns:
        A `MultiProcessAdapter`: `logger.info(msg, main_process_only=False, in_order=False)`.

    Raises:
        ValueError: for a level (or ACCELERATE_LOG_LEVEL value) that is not a level name.
    """
    if not isinstance(name, str):
        raise TypeError(f"`get_logger(name=...)` must be a str, such as __name__. Received: name={short_repr(name)} "
                        f"({type(name).__name__}).")
    if log_level is not None:
        level = _check_level(log_level, "`get_logger(log_level=...)`")
    elif os.environ.get(LOG_LEVEL_ENV):
        level = _check_level(os.environ[LOG_LEVEL_ENV], f"The environment variable {LOG_LEVEL_ENV}")
    else:
        level = None
    logger = logging.getLogger(name)
    if level is not None:
        # As Accelerate: the root logger too, so handlers set up by basicConfig show these records.
        logger.setLevel(level)
        logging.getLogger().setLevel(level)
    return MultiProcessAdapter(logger, {})
