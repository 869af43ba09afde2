"""MixedPrecision: train in bf16 or fp16 by configuring the Accelerator before it prepares the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fittrain.trainer.events import Callback

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

_PRECISIONS = ("no", "fp16", "bf16")


class MixedPrecision(Callback):
    """Runs `training_step` and `validation_step` under autocast to bf16 or fp16.

    It sets `trainer.accelerator.mixed_precision` in `on_fit_start`, the one event that runs
    before `prepare()`, so the whole step is autocast. "fp16" also gets a GradScaler, which
    scales the loss against underflow and skips steps whose gradients overflowed; its state is
    saved in checkpoints as `scaler.pt`. "bf16" needs no scaler: it has fp32's exponent range.

    Args:
        precision: "no", "fp16" or "bf16".

    Raises:
        ValueError: for any other precision.

    Example:
        >>> Trainer(callbacks=[MixedPrecision("bf16")]).fit(module, loader)
    """

    def __init__(self, precision: str) -> None:
        if precision not in _PRECISIONS:
            raise ValueError("`MixedPrecision(precision=...)` must be one of 'no', 'fp16' or 'bf16'. "
                             f"Received: precision={precision!r}.")
        self.precision = precision

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Sets the Accelerator's precision before the model is prepared."""
        trainer.accelerator.mixed_precision = self.precision

    def __repr__(self) -> str:
        return f"MixedPrecision({self.precision!r})"
