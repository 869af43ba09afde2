"""Mixed precision: autocast and loss scaling behind one small interface.

`FullPrecision` does nothing at all, so code that uses a precision object never asks which mode
is on. `AutocastPrecision` (bf16) adds autocast; `ScaledPrecision` (fp16) adds a GradScaler.
fp16 works on CPU too: torch autocasts to float16 there and its GradScaler runs on "cpu".
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager

import torch

from fittrain.common.nested import map_tensors

PRECISIONS = ("no", "fp16", "bf16")


def to_fp32(obj: Any) -> Any:
    """Returns `obj` with every half-precision tensor inside it converted to float32.

    Lists, tuples, namedtuples and dicts are walked recursively; other values pass through.
    """
    return map_tensors(_upcast, obj)


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


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


def remove_autocast_forward(module: torch.nn.Module) -> None:
    """Undoes `wrap_forward` on `module` (`unwrap_model(keep_fp32_wrapper=False)`); a compiled
    forward under the wrapper stays."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, AutocastForward):
        return
    if getattr(forward.original, "__self__", None) is module:  # the class's own forward needs no attribute
        del module.forward
    else:
        module.forward = forward.original


class FullPrecision:
    """Precision "no": every method is a no-op or a plain call."""

    name = "no"
    #: Autocasts nothing and scales nothing: backward and the optimizer step are torch's own calls,
    #: which the Trainer then makes directly (fittrain/trainer/optimization.py).
    plain = True
    # nullcontext is reusable and stateless: one instance serves every step.
    _NO_AUTOCAST = contextlib.nullcontext()

    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None) -> ContextManager[None]:
        """A context in which eligible ops run in lower precision; here, nothing changes.

        `enabled=False` runs the block in full precision; `cache_enabled` is `torch.autocast`'s.
        """
        return self._NO_AUTOCAST

    def wrap_forward(self, model: torch.nn.Module) -> None:
        """Makes `model.forward` autocast; full precision leaves it alone so it costs nothing."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the loss before backward to keep fp16 gradients from underflowing."""
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients of `optimizer` by the loss scale, once per step."""

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Notes an optimizer prepared with this precision (the loss scaler adapts to several)."""

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

    plain = False

    def __init__(self, device_type: str, dtype: torch.dtype, name: str) -> None:
        self.name = name
        self._device_type = device_type
        self._dtype = dtype

    def autocast(self, enabled: bool = True, cache_enabled: bool | None = None) -> ContextManager[None]:
        return torch.autocast(device_type=self._device_type, dtype=self._dtype, enabled=enabled,
                              cache_enabled=cache_enabled)

    def wrap_forward(self, model: torch.nn.Module) -> None:
        if not isinstance(model.__dict__.get("forward"), AutocastForward):
            model.forward = AutocastForward(model.forward, self)


class ScaledPrecision(AutocastPrecision):
    """fp16: autocast plus a GradScaler, which skips steps whose gradients overflowed.

    With one optimizer, `step()` updates the scale right after the step, as Accelerate does. With
    several, PyTorch's rule holds: each optimizer steps through the scaler, and the scale is
    updated once, after all of them, because an update between two steps would unscale the second
    optimizer's gradients by a scale they were not multiplied with. The update waits until the
    next backward (`scale_loss`) or `state_dict()`, which serves both orders users write:
    backward D, step D, backward G, step G (each backward flushes the update of the step before),
    and backward D and G, then step both (one update, with both optimizers' overflow checks).
    Whether a step was skipped is read per optimizer from the scaler's inf checks.
    """

    def __init__(self, device_type: str, **scaler_arguments: Any) -> None:
        super().__init__(device_type, torch.float16, "fp16")
        self.scaler = torch.amp.GradScaler(device_type, **scaler_arguments)
        # GradScaler refuses a second unscale_ per step; clipping and step() may both ask.
        self._unscaled: set[int] = set()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._stepped: set[int] = set()  # optimizers stepped since the last scaler.update()

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._stepped:
            self._update()
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._stepped:
            self._update()  # stepped again without a backward in between: a new iteration
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
        # The overflow check is read before the optimizer's kernels are queued: GradScaler.step waits
        # for it at this point anyway, whereas reading anything from the GPU after the step (the scale,
        # say) would wait for the step's kernels too and leave the GPU idle until the next forward.
        self.unscale_(optimizer)
        found_inf = self._found_inf(optimizer)
        scale_before = self.scaler.get_scale() if found_inf is None else None
        self.scaler.step(optimizer)
        self._unscaled.discard(id(optimizer))
        if len(self._optimizers) > 1 and found_inf is not None:
            self._stepped.add(id(optimizer))  # updated at the next backward or state_dict()
            return not found_inf
        self.scaler.update()
        if found_inf is not None:
            return not found_inf
        # Without a per-optimizer record, the scale tells: the scaler lowers it exactly when it
        # skipped the step for inf/NaN gradients.
        return self.scaler.get_scale() >= scale_before

    def _found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Whether the scaler found inf/NaN in `optimizer`'s gradients at its last step (None when
        this torch's GradScaler keeps no per-optimizer record, so the scale must tell)."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        found = states.get(id(optimizer), {}).get("found_inf_per_device") if isinstance(states, dict) else None
        if not found:
            return None
        return bool(sum(float(v.item()) for v in found.values()))

    def _update(self) -> None:
        self.scaler.update()
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        if self._stepped:
            self._update()  # a checkpoint holds the scale the next backward would use
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._stepped.clear()
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


def make_precision(mode: str | None, device: torch.device,
                   scaler_arguments: dict[str, Any] | None = None) -> FullPrecision:
    """Builds the precision object for `mode` ("no", "fp16" or "bf16") on `device`; fp16's loss
    scaler takes `scaler_arguments` (`torch.amp.GradScaler`'s, from GradScalerKwargs)."""
    mode = check_precision(mode)
    if mode == "fp16":
        return ScaledPrecision(device.type, **(scaler_arguments or {}))
    if mode == "bf16":
        return AutocastPrecision(device.type, torch.bfloat16, "bf16")
    return FullPrecision()
