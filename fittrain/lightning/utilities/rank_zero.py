"""Lightning's `rank_zero_only` and the messages that go out on the process of global rank 0 only."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, TypeVar

from fittrain.accelerator.process_logging import process_index

T = TypeVar("T")
_log = logging.getLogger(__name__)


def rank_zero_only(fn: Callable[..., T], default: Any = None) -> Callable[..., T | Any]:
    """Decorates `fn` to run on the process of global rank 0 only; the others get `default`.

    The rank is read at each call: the process group's once there is one, else torchrun's (or
    SLURM's) variables, 0 for a lone process. So it is right from the first line of a script.

    Example:
        >>> @rank_zero_only
        ... def save_samples(images): ...
    """

    @functools.wraps(fn)
    def on_rank_zero(*args: Any, **kwargs: Any) -> T | Any:
        return fn(*args, **kwargs) if process_index() == 0 else default

    return on_rank_zero


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """`logging.info` on rank 0 only."""
    _log.info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """`logging.debug` on rank 0 only."""
    _log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """`warnings.warn` on rank 0 only."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)
