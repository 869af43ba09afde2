"""Mixed precision: autocast and loss scaling behind one small interface.

`FullPrecision` does nothing at all, so code that uses a precision object never asks which mode
is on. `AutocastPrecision` (bf16) adds autocast; `ScaledPrecision` (fp16) adds a GradScaler.
fp16 works on CPU too: torch autocasts to float16 there and its GradScaler runs on "cpu".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

PRECISIONS = ("no", "fp16", "bf16")


def to_fp32(obj: Any) -> Any:
    """Returns `obj` with every half-precision tensor inside it converted to float32.

    Lists, tuples, namedtuples and dicts are walked recursively; other values pass through.
    """
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, dict):
        return type(obj)((k, to_fp32(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_fp32(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_fp32(v) for v in obj)
    return obj


class AutocastForward:
    """A model's forward, run under autocast, with floating outputs returned as float32.

    It replaces `model.forward` on the instance; `original` restores it.
    """

    def __init__(self, original: Callable[..., Any], precision: "FullPrecision") -> None:
        self.original = original
        self._precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._precision.autocast():
            out = self.original(*args, **kwargs)
        return to_fp32(out)


class FullPrecision:
    """Precision "no": every method is a no-op or a plain call."""

    name = "no"
    # nullcontext is reusable and stateless: one instance serves every step.
    _NO_AUTOCAST = contextlib.nullcontext()

    def autocast(self) -> ContextManager[None]:
        """A context in which eligible ops run in lower precision; here, nothing changes."""
        return self._NO_AUTOCAST

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Makes `model.forward` autocast; full precision leaves it alone so it costs nothing."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the loss before backward to keep fp16 gradients from underflowing."""
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients of `optimizer` by the loss scale, once per step."""

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        """Steps `optimizer` (with `closure`, as `Optimizer.step` takes it); returns False when the
        step was skipped for inf/NaN gradients."""
        if closure is None:
            optimizer.step()
        else:
            optimizer.step(closure)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state, empty without a scaler."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""


class AutocastPrecision(FullPrecision):
    """Autocast to a lower dtype (bf16) with no loss scaling: bf16 has fp32's exponent range."""

    def __init__(self, device_type: str, dtype: torch.dtype, name: str) -> None:
        self.name = name
        self._device_type = device_type
        self._dtype = dtype

    def autocast(self) -> ContextManager[None]:
        return torch.autocast(device_type=self._device_type, dtype=self._dtype)

    def wrap_forward(self, model: torch.nn.Module) -> None:
        if not isinstance(model.__dict__.get("forward"), AutocastForward):
            model.forward = AutocastForward(model.forward, self)


class ScaledPrecision(AutocastPrecision):
    """fp16: autocast plus a GradScaler, which skips steps whose gradients overflowed."""

    def __init__(self, device_type: str) -> None:
        super().__init__(device_type, torch.float16, "fp16")
        self.scaler = torch.amp.GradScaler(device_type)
        # GradScaler refuses a second unscale_ per step; clipping and step() may both ask.
        self._unscaled: set[int] = set()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> bool:
        if closure is not None:
            # A closure recomputes the loss unscaled and steps past the scaler: the update would use
            # scaled gradients. GradScaler has no closure support either, so refuse it plainly.
            raise ValueError(
                "optimizer.step(closure) is not supported with mixed_precision='fp16': the loss scaler cannot "
                f"scale what the closure computes. Received: closure={closure!r}. Call backward on the scaled "
                "loss and step without a closure, or use bf16 or full precision for closure-based optimizers "
                "such as LBFGS.")
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled.discard(id(optimizer))
        # The scaler lowers its scale exactly when it skipped the step for inf/NaN gradients.
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)



def check_precision(value: Any, argument: str = "mixed_precision") -> str:
    """Validates a precision name, mapping None to "no".

    Raises:
        ValueError: naming `argument` and the value received.
    """
    if value is None:
        return "no"
    if value not in PRECISIONS:
        raise ValueError(
            f"`{argument}` must be one of 'no', 'fp16' or 'bf16'. Received: {argument}={value!r}."
        )
    return value


def make_precision(mode: str | None, device: torch.device) -> FullPrecision:
    """Builds the precision object for `mode` ("no", "fp16" or "bf16") on `device`."""
    mode = check_precision(mode)
    if mode == "fp16":
        return ScaledPrecision(device.type)
    if mode == "bf16":
        return AutocastPrecision(device.type, torch.bfloat16, "bf16")
    return FullPrecision()
