"""Checks of the arguments that save and load checkpoints, shared by `save_state`/`load_state` and
the Checkpointer callback, so that a bad value is refused at the call, in the same words everywhere.
"""

from __future__ import annotations

import os
from typing import Any

from fittrain.common.reprs import short_repr


def check_async_save(value: Any, call: str) -> bool:
    """Returns `async_save` when it is a bool.

    Args:
        value: The `async_save` received.
        call: Who received it, for the message ("save_state", "Checkpointer").

    Raises:
        TypeError: for anything but True or False (a truthy "yes" would silently switch modes).
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{call}(async_save=...)` must be True or False. Received: async_save={short_repr(value)} "
                        f"(type {type(value).__name__}). Pass async_save=True to write checkpoints in the background.")
    return value


def check_folder(value: Any, call: str, name: str) -> None:
    """Refuses a checkpoint folder argument that is neither None nor a path.

    Args:
        value: The argument received.
        call: The method, for the message ("load_state").
        name: The argument's name ("input_dir").

    Raises:
        TypeError: naming the argument, the value and what to pass.
    """
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{call}({name}=...)` must be a checkpoint folder's path (a str or os.PathLike), or None for "
                        f"automatic naming. Received: {name}={short_repr(value)} (type {type(value).__name__}). Pass a "
                        "folder such as the one save_state() returned, e.g. 'checkpoints/checkpoint_3'.")
