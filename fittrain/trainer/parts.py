"""Small pieces of the Trainer's loop: argument checks, loss extraction, metric bookkeeping.

Kept apart so `trainer.py` reads as the loop and nothing else.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.data import IterableDataset

from fittrain.common.reprs import short_repr
from fittrain.data import batch_size_of
from fittrain.distributed import collectives
from fittrain.trainer.metric_objects import as_metric, computed

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator
    from fittrain.distributed.strategies import Strategy
    from fittrain.trainer.module import TrainModule


def length_of(loader: Any) -> int | None:
    """The number of batches of `loader` per epoch, or None for a stream, which has no usable length.

    A DataLoader over an IterableDataset counts as a stream even when the dataset defines
    `__len__`: that length is a hint, which workers and sharding do not follow.
    """
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    try:
        return len(loader)
    except TypeError:  # no __len__, or one that says the length is unknown
        return None


def empty_epoch_error(epoch: int, loader: Any) -> ValueError:
    """The error for a train loader that yielded no batch in a whole epoch (a stream that ran dry)."""
    return ValueError(
        f"`train_loader` yielded no batch in epoch {epoch}: there is nothing to train on (with max_steps alone, "
        f"the Trainer would start empty epochs forever). Received: train_loader={short_repr(loader)} "
        f"({type(loader).__name__}). A stream must yield at least one batch per pass: make its __iter__ start over "
        "each time it is called (an iterator that is exhausted after one pass yields nothing the next time), and "
        "check the data source, batch_size and drop_last.")


def check_accelerator(accelerator: Any) -> None:
    """Raises unless `accelerator` is None or a fittrain.Accelerator."""
    from fittrain.accelerator.accelerator import Accelerator  # here: accelerator.py is the heavier module

    if accelerator is not None and not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"`accelerator` must be a fittrain.Accelerator or None. Received: accelerator={short_repr(accelerator)} "
            f"({type(accelerator).__name__}). It is not a device name: to train on the CPU pass "
            "accelerator=Accelerator(cpu=True), or leave it out and the Trainer picks the device.")


def check_path(name: str, value: Any, optional: bool = False) -> None:
    """Raises unless `value` is a str or os.PathLike (or None when `optional`)."""
    if (value is None and optional) or isinstance(value, (str, os.PathLike)):
        return
    allowed = "a str or os.PathLike such as pathlib.Path" + (", or None" if optional else "")
    raise TypeError(f"`{name}` must be {allowed}. Received: {name}={short_repr(value)} ({type(value).__name__}).")


def check_loader(name: str, loader: Any) -> None:
    """Raises a TypeError naming `name` for a loader that is missing or cannot be iterated."""
    if loader is None or isinstance(loader, (str, bytes)) or not isinstance(loader, Iterable):
        raise TypeError(f"`{name}` must be a DataLoader or a list of batches. Received: {name}={short_repr(loader)} "
                        f"({type(loader).__name__}). Pass e.g. DataLoader(dataset, batch_size=32).")


def explain_backward_error(loss: torch.Tensor, error: RuntimeError) -> None:
    """Raises a ValueError naming training_step when `error` came from a loss without a graph."""
    if not loss.requires_grad:
        raise ValueError(
            f"training_step returned a loss that does not require grad (requires_grad=False, grad_fn=None), so "
            f"backward cannot train anything. Received: {short_repr(loss.detach())}. It was detached (.detach(), "
            ".item(), torch.tensor(...)), computed under torch.no_grad(), or every parameter it uses has "
            "requires_grad=False. Return the loss computed from the module's output.") from error


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


#: The step methods the loops call, each as `method(batch)` or, when it takes one, `method(batch, batch_idx)`.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class StepRunner:
    """Calls `module.<method>(batch[, batch_idx])` for the loops: `runner("training_step", batch, 3)`.

    A step method receives `batch_idx` when its signature takes a second positional argument
    (Lightning's `training_step(self, batch, batch_idx)`), decided once here, not per call.

    DDP synchronises gradients and FSDP2 gathers parameters only inside their own forward, so
    under either the step method runs through the wrapper: the wrapped module's forward is
    pointed at the method for one call. Without a wrapper the method is called directly.

    Args:
        model: The prepared model (or, for manual optimization under DDP, the module itself).
        module: The TrainModule whose method runs.
        strategy: The distributed strategy, which says whether it hooks the module's forward.

    Raises:
        TypeError: for a step method that can take neither `(batch)` nor `(batch, batch_idx)`.
    """

    def __init__(self, model: nn.Module, module: "TrainModule", strategy: "Strategy") -> None:
        self.model, self.module = model, module
        # Decided once: None calls the method directly (no wrapper), else the module whose forward is pointed.
        direct = model is module and not strategy.hooks_forward(module)
        self._inner: nn.Module | None = None if direct else strategy.unwrap(model)
        self._with_index = {name: takes_batch_idx(module, name) for name in STEP_METHODS}

    def bound(self, method: str) -> tuple[Callable[..., Any], bool]:
        """The cheapest callable running `method`, and whether it takes `batch_idx` after the batch: the
        module's own bound method when it runs directly, else this runner's call (which always does)."""
        if self._inner is None:
            return getattr(self.module, method), self._with_index[method]
        return functools.partial(self, method), True

    def __call__(self, method: str, batch: Any, batch_idx: int = 0) -> Any:
        args = (batch, batch_idx) if self._with_index[method] else (batch,)
        inner, module = self._inner, self.module
        if inner is None:
            return getattr(module, method)(*args)
        original = inner.__dict__.get("forward")

        def step_forward(*args: Any, **kwargs: Any) -> Any:
            _restore_forward(inner, original)  # inside the step, self(x) is the real forward again
            return getattr(module, method)(*args, **kwargs)

        inner.forward = step_forward
        try:
            return self.model(*args)
        finally:
            _restore_forward(inner, original)


def takes_batch_idx(module: "TrainModule", name: str) -> bool:
    """Whether `module.<name>` takes `(batch, batch_idx)` rather than `(batch)`.

    Raises:
        TypeError: when it can take neither, naming the method and its signature.
    """
    method = getattr(module, name)
    try:
        signature = inspect.signature(method)
    except ValueError:  # no signature to read (a builtin): call it the plain way
        return False
    for args in (("batch", "batch_idx"), ("batch",)):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return len(args) == 2
    raise TypeError(f"{type(module).__name__}.{name}{signature} cannot be called as {name}(batch) or "
                    f"{name}(batch, batch_idx). Define it as def {name}(self, batch) or "
                    f"def {name}(self, batch, batch_idx); a dataloader_idx needs a default (dataloader_idx=0).")


def _restore_forward(module: nn.Module, original: Any) -> None:
    if original is not None:
        module.forward = original
    else:
        module.__dict__.pop("forward", None)


def describe(value: Any, depth: int = 0) -> str:
    """A one-line summary of a returned structure: short values as repr, objects by type name."""
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(describe(v, depth + 1) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict) and depth < 2:
        return "{" + ", ".join(f"{k!r}: {describe(v, depth + 1)}" for k, v in list(value.items())[:6]) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return short_repr(value, 40)
    return type(value).__name__


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
        self._logged: set[str] = set()  # names the current batch's step recorded with self.log
        self.metrics: dict[str, Any] = {}  # name -> torchmetrics Metric logged (fittrain/trainer/metric_objects.py)

    def log(self, name: str, value: Any, batch_size: int | None = None) -> None:
        """Adds a value the step recorded with `self.log` (weighted by `batch_size` when given); it wins
        over a returned value of the same name."""
        self._logged.add(name)
        if as_metric(value) is not None:  # a torchmetrics Metric: its compute() at the loop's end
            self.metrics[name] = value
            return
        self.add(name, value, batch_size)

    def add(self, name: str, value: Any, weight: float | None = None) -> None:
        """Adds one batch's value of `name`, weighted by that batch's size (or `weight`)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Validation metric {name!r} must be a scalar. Received shape {tuple(value.shape)}.")
            value = value.detach().float().reshape(()).to(self.device)
        weight = self._weight if weight is None else weight
        self.sums[name] = self.sums.get(name, 0.0) + value * weight
        self.counts[name] = self.counts.get(name, 0.0) + weight

    def start_batch(self, batch: Any) -> None:
        """Weights what the next step returns and logs by `batch`'s size; call it before the step,
        so values the step records with `self.log` get its weight too."""
        self._weight = batch_size_of(batch) or 1
        self._logged.clear()

    def add_output(self, output: Any, method: str = "validation_step") -> None:
        """Adds what `method` (validation_step, test_step) returned for the batch: a scalar (val_loss,
        or test_loss from test_step) or a dict. A name the step also logged with `self.log` is taken
        from the log only: Lightning programs log their loss and return it too."""
        if output is None:
            return
        if not isinstance(output, dict):
            if not (isinstance(output, numbers.Real) or _is_scalar(output)):  # a NumPy scalar is a number too
                raise TypeError(f"{method} must return a scalar or a dict of scalars. Received: "
                                f"{type(output).__name__}{tuple(getattr(output, 'shape', ()))}.")
            output = {"test_loss" if method == "test_step" else "val_loss": output}
        for name, value in output.items():
            if name not in self._logged:
                self.add(name, value)

    def result(self, accelerator: "Accelerator") -> dict[str, float]:
        """The averages over every process (all ranks must call this)."""
        # Each Metric's compute() (a collective of torchmetrics' own), in the same order on every process.
        metrics = {name: computed(name, metric) for name, metric in sorted(self.metrics.items())}
        names = sorted(set().union(*collectives.gather_object(sorted(self.sums), accelerator.state)))
        if not names:
            return metrics
        table = torch.zeros(2, len(names), dtype=torch.float64, device=self.device)
        for j, name in enumerate(names):
            if name in self.sums:
                table[0, j] = torch.as_tensor(self.sums[name], dtype=torch.float64)
                table[1, j] = self.counts[name]
        table = accelerator.reduce(table, reduction="sum")
        means = {name: float(table[0, j] / table[1, j]) for j, name in enumerate(names) if table[1, j] > 0}
        return {**means, **metrics}
