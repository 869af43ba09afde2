"""`ModelSummary`: Lightning's parameter table when a fit starts, laid out by fittrain's `summarize`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fittrain.common.reprs import short_repr
from fittrain.lightning.callbacks.base import Callback
from fittrain.trainer.events import Callback as NativeCallback
from fittrain.trainer.summary import summarize

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class ModelSummary(Callback):
    """Lightning's `ModelSummary`: prints the module's parameter table (fittrain/trainer/summary.py)
    when fit starts, on the main process.

    Args:
        max_depth: How deep submodules are listed: 1 the children, -1 all, 0 the totals only.

    Raises:
        ValueError: for a max_depth that is not an int of at least -1.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(f"`ModelSummary(max_depth=...)` must be an int of at least -1. Received: "
                             f"max_depth={short_repr(max_depth)}.")
        if summarize_kwargs:
            raise ValueError(f"`ModelSummary({', '.join(summarize_kwargs)}=...)` is not supported by "
                             "fittrain.lightning: it takes max_depth only.")
        self.max_depth = max_depth

    def native_callbacks(self, trainer: "Trainer") -> list[NativeCallback]:
        return [_Print(self.max_depth), *super().native_callbacks(trainer)]


class _Print(NativeCallback):
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Any) -> None:
        if self.max_depth != 0 and trainer.accelerator.is_main_process:
            print(summarize(trainer.module, self.max_depth))
