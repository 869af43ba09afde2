"""`TQDMProgressBar`: Lightning's progress bar, drawn by fittrain's `ProgressBar` (a tqdm bar per epoch
and a transient one per validation, on the main process; the values logged with prog_bar=True)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fittrain.common.checks import check_bool
from fittrain.common.reprs import short_repr
from fittrain.lightning.callbacks.base import Callback
from fittrain.trainer.progress import ProgressBar as NativeProgressBar

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class ProgressBar(Callback):
    """Lightning's base class of progress bars (`isinstance(cb, ProgressBar)` finds TQDMProgressBar, as in
    Lightning); fittrain draws only TQDMProgressBar's bar."""


class TQDMProgressBar(ProgressBar):
    """Lightning's `TQDMProgressBar`, mapped onto fittrain's `ProgressBar` (fittrain/trainer/progress.py).

    Args:
        refresh_rate: 0 hides the bars; any other rate shows them, redrawn at most ten times a second
            (fittrain's rate, whatever the number: redrawing costs time on the training path).
        process_position: Only 0 (one bar position; fittrain draws on the main process).
        leave: False (Lightning's default): one bar, reset at each epoch; True: each epoch's bar stays.

    Raises:
        ValueError: for a negative refresh_rate, or another process_position.
        TypeError: for a leave that is not a bool.
    """

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
            raise ValueError(f"`TQDMProgressBar(refresh_rate=...)` must be an int of at least 0. Received: "
                             f"refresh_rate={short_repr(refresh_rate)}.")
        if process_position != 0:
            raise ValueError("`TQDMProgressBar(process_position=...)` takes only the default, 0, in "
                             "fittrain.lightning: fittrain draws one set of bars on the main process. Received: "
                             f"process_position={short_repr(process_position)}.")
        self.refresh_rate = refresh_rate
        self.process_position = process_position
        self.leave = check_bool("leave", leave, owner="TQDMProgressBar")
        self.bar = NativeProgressBar(enabled=refresh_rate > 0, leave=leave)

    @property
    def is_enabled(self) -> bool:
        return self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self.bar.enabled = False

    def enable(self) -> None:
        self.bar.enabled = True

    def native_callbacks(self, trainer: "Trainer") -> list[Any]:
        return [self.bar, *super().native_callbacks(trainer)]
