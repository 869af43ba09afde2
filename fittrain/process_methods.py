"""The Accelerator's methods that involve every process: barriers, gathers, reductions, broadcasts.

A mixin of `Accelerator`, kept apart so the facade stays short; it uses the Accelerator's
`state` (the process group) and `gradient_state` (which knows the padded last batch).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

import torch

from . import collectives
from .state import ProcessState
from .sync import GradientState


class ProcessMethods:
    """Accelerate's multi-process helpers; every method works on one process too."""

    # What the Accelerator provides (declared here so the methods below read on their own).
    state: ProcessState
    gradient_state: GradientState

    def wait_for_everyone(self) -> None:
        """Blocks until every process reaches this line."""
        self.state.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print`, on the main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def gather(self, tensor: Any) -> Any:
        """Concatenates tensors (or nested structures of them) from all processes along dim 0."""
        return collectives.gather(tensor, self.state)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gathers like `gather`, then drops the samples that even_batches repeated at the end."""
        # A rank whose ready batch (batch_size=None) only pads the last round contributes nothing.
        padding = 0 < self.gradient_state.real_ranks <= self.state.process_index
        if use_gather_object or not _holds_tensors(input_data):
            mine = [] if padding else input_data
            gathered = [x for part in collectives.gather_object(mine, self.state) for x in _as_list(part)]
        else:
            gathered = collectives.gather(_emptied(input_data) if padding else input_data, self.state)
        # Set by the prepared loader on a batch of a padded round only (not just the last batch: a
        # stream read by several workers has a padded round at the end of each worker's share).
        remainder = self.gradient_state.remainder
        if remainder:
            gathered = _truncate(gathered, remainder)
        return gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sums or averages tensors across processes."""
        return collectives.reduce(tensor, self.state, reduction, scale)

    def broadcast(self, obj: Any, from_process: int = 0) -> Any:
        """Copies tensors, or any picklable object, from `from_process` to all processes."""
        if _holds_tensors(obj):
            return collectives.broadcast(obj, self.state, from_process)
        return collectives.broadcast_object(obj, self.state, from_process)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pads tensors along `dim` to the largest size on any process."""
        return collectives.pad_across_processes(tensor, self.state, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """A context that yields this process's share of `inputs`."""
        return collectives.split_between_processes(inputs, self.state, apply_padding)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Runs the block on the main process first, then on the others (e.g. to download once)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like `main_process_first`, per node."""
        with self.main_process_first():
            yield


def _holds_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return bool(obj) and all(_holds_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return bool(obj) and all(_holds_tensors(v) for v in obj)
    return False


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _emptied(data: Any) -> Any:
    """`data` with every tensor cut to length 0 along its first dimension (a 0-d one becomes shape (0,))."""
    if isinstance(data, torch.Tensor):
        return (data if data.ndim else data[None])[:0]
    if isinstance(data, dict):
        return type(data)((k, _emptied(v)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_emptied(v) for v in data))
    return type(data)(_emptied(v) for v in data)


def _truncate(data: Any, length: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[:length]
    if isinstance(data, dict):
        return type(data)((k, _truncate(v, length)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_truncate(v, length) for v in data))
    if isinstance(data, (list, tuple)) and data and all(isinstance(v, torch.Tensor) for v in data):
        return type(data)(_truncate(v, length) for v in data)
    return data[:length]
