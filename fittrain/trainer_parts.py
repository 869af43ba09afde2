"""Small pieces of the Trainer's loop: argument checks, loss extraction, metric bookkeeping.

Kept apart so `trainer.py` reads as the loop and nothing else.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from . import collectives
from .data import batch_size_of
from .parallel import is_fsdp, unwrap

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .module import TrainModule


def check_count(name: str, value: Any, optional: bool = False) -> Any:
    """Validates a positive integer argument (None allowed when `optional`).

    Raises:
        ValueError: naming the argument and the value received.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive integer or None" if optional else "a positive integer"
        raise ValueError(f"`{name}` must be {allowed}. Received: {name}={value!r}.")
    return value


def warn_once(owner: Any, message: str) -> None:
    """Warns with `message` once per `owner` (a Trainer), not once per batch."""
    seen = owner.__dict__.setdefault("_warned", set())
    if message not in seen:
        seen.add(message)
        warnings.warn(message, stacklevel=3)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.ndim <= 1


def extract_loss(output: Any) -> torch.Tensor | None:
    """The loss inside `training_step`'s return value, or None for a skipped batch.

    Raises:
        TypeError: for a return that is neither a tensor, a dict nor None.
        ValueError: for a non-scalar loss or a dict without "loss".
    """
    if type(output) is torch.Tensor and output.ndim == 0:
        return output  # the common case first: this runs every step
    if output is None:
        return None
    if isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(f"training_step returned a dict without a 'loss' key. Received keys: "
                             f"{sorted(output)}. Return {{'loss': loss, ...}}.")
        output = output["loss"]
        if output is None:
            return None
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"training_step must return a scalar loss tensor, a dict with 'loss', or None. "
                        f"Received: {type(output).__name__} ({output!r}).")
    if not _is_scalar(output):
        raise ValueError(f"training_step must return a scalar loss. Received a tensor of shape "
                         f"{tuple(output.shape)}; reduce it, e.g. loss.mean().")
    return output if output.ndim == 0 else output.reshape(())


def make_step_runner(model: nn.Module, module: "TrainModule") -> Callable[[str, Any], Any]:
    """Returns `run(method, batch)`, which calls `module.<method>(batch)` for the loop.

    DDP synchronises gradients and FSDP2 gathers parameters only inside their own forward, so
    under either the step method runs through the wrapper: the wrapped module's forward is
    pointed at the method for one call. Without a wrapper the method is called directly.
    """
    if model is module and not is_fsdp(module):
        return lambda method, batch: getattr(module, method)(batch)
    inner = unwrap(model)

    def run(method: str, batch: Any) -> Any:
        original = inner.__dict__.get("forward")

        def step_forward(*args: Any, **kwargs: Any) -> Any:
            _restore_forward(inner, original)  # inside the step, self(x) is the real forward again
            return getattr(module, method)(*args, **kwargs)

        inner.forward = step_forward
        try:
            return model(batch)
        finally:
            _restore_forward(inner, original)

    return run


def _restore_forward(module: nn.Module, original: Any) -> None:
    if original is not None:
        module.forward = original
    else:
        module.__dict__.pop("forward", None)


def split_optimizers(module: "TrainModule") -> tuple[torch.optim.Optimizer, Any, bool]:
    """Interprets `configure_optimizers()`.

    Returns:
        (optimizer, scheduler or None, whether the scheduler steps per epoch instead of per step).
    """
    result = module.configure_optimizers()
    scheduler: Any = None
    if isinstance(result, dict):
        optimizer, scheduler = result.get("optimizer"), result.get("lr_scheduler")
    elif isinstance(result, (tuple, list)) and len(result) == 2:
        optimizer, scheduler = result
    else:
        optimizer = result
    per_epoch = False
    if isinstance(scheduler, dict):  # Lightning-style {"scheduler": s, "interval": "epoch"|"step"}
        per_epoch = scheduler.get("interval", "step") == "epoch"
        scheduler = scheduler.get("scheduler")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("configure_optimizers must return an optimizer, an (optimizer, scheduler) pair, or "
                        f"{{'optimizer': ..., 'lr_scheduler': ...}}. Received: {result!r}.")
    return optimizer, scheduler, per_epoch


class LazyMetrics(dict):
    """Metric values that may still be device tensors; converted to floats only when read."""

    def as_floats(self) -> dict[str, float]:
        """Converts pending tensors (one device sync each, once) and returns plain floats."""
        for name, value in self.items():
            if isinstance(value, torch.Tensor):
                self[name] = float(value.item() if value.numel() == 1 else value.float().mean().item())
        return {name: float(value) for name, value in self.items()}


class ValidationAverager:
    """Averages validation metrics over samples and processes, with one collective at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}
        self._weight = 1

    def add(self, name: str, value: Any) -> None:
        """Adds one batch's value of `name`, weighted by that batch's size."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Validation metric {name!r} must be a scalar. Received shape {tuple(value.shape)}.")
            value = value.detach().float().reshape(()).to(self.device)
        self.sums[name] = self.sums.get(name, 0.0) + value * self._weight
        self.counts[name] = self.counts.get(name, 0.0) + self._weight

    def add_output(self, output: Any, batch: Any) -> None:
        """Adds what `validation_step` returned for `batch`: a scalar (val_loss) or a dict."""
        self._weight = batch_size_of(batch) or 1
        if output is None:
            return
        if not isinstance(output, dict):
            if not (isinstance(output, (int, float)) or _is_scalar(output)):
                raise TypeError(f"validation_step must return a scalar or a dict of scalars. Received: "
                                f"{type(output).__name__}{tuple(getattr(output, 'shape', ()))}.")
            output = {"val_loss": output}
        for name, value in output.items():
            self.add(name, value)

    def result(self, accelerator: "Accelerator") -> dict[str, float]:
        """The averages over every process (all ranks must call this)."""
        names = sorted(set().union(*collectives.gather_object(sorted(self.sums), accelerator.state)))
        if not names:
            return {}
        table = torch.zeros(2, len(names), dtype=torch.float64, device=self.device)
        for j, name in enumerate(names):
            if name in self.sums:
                table[0, j] = torch.as_tensor(self.sums[name], dtype=torch.float64)
                table[1, j] = self.counts[name]
        table = accelerator.reduce(table, reduction="sum")
        return {name: float(table[0, j] / table[1, j]) for j, name in enumerate(names) if table[1, j] > 0}
