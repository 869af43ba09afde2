"""The errors of the checkpoint subsystem: a folder that is damaged, gone, or does not fit the run.

Every message names the file at fault. Loading the newest checkpoint (`latest.load_newest`)
passes over a folder that raises `CheckpointError` (damaged) or `CheckpointDeletedError` (pruned
while it was read), but never over a `CheckpointMismatchError`, which an older checkpoint would
not cure.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, damaged or unsafe; the message names the bad file."""


class CheckpointDeletedError(CheckpointError):
    """A checkpoint folder was deleted or replaced while it was being read (such as by pruning)."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint that this run cannot continue from (other models, optimizers, precision
    or number of processes, or registered objects that refuse their state)."""


def brief(err: BaseException) -> str:
    """The line of an error that says what went wrong, without torch's advice to unpickle."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    unpickler = [line for line in lines if "WeightsUnpickler error" in line]
    return (unpickler or lines or [type(err).__name__])[0]

