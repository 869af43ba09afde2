"""Methods that involve every process: facts, barriers, gathers, reductions, broadcasts, decorators.

`ProcessHelpers` needs only a `state` (the process group's facts): `PartialState` and the
Accelerator share it. `ProcessMethods`, the Accelerator's mixin, adds what also needs its
`gradient_state` (which knows the padded last batch): `gather_for_metrics`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

import torch

from fittrain.common.checks import check_non_negative_int
from fittrain.common.nested import is_tensor_tree, map_tensors
from fittrain.distributed import collectives
from fittrain.distributed.gradient_state import GradientState
from fittrain.distributed.process_state import ProcessState


class ProcessHelpers:
    """Accelerate's multi-process helpers; every method works on one process too."""

    state: ProcessState  # what the class using this mixin provides

    # ----------------------------------------------------------------- facts
    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self.state.device

    @property
    def num_processes(self) -> int:
        """How many processes take part."""
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node."""
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 on its node."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the last global rank (the main process when there is one)."""
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.state.is_distributed

    # ----------------------------------------------------------------- collectives
    def wait_for_everyone(self) -> None:
        """Blocks until every process reaches this line."""
        self.state.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print`, on each node's main process only."""
        self.state.print(*args, **kwargs)

    def gather(self, tensor: Any) -> Any:
        """Concatenates tensors (or nested structures of them) from all processes along dim 0."""
        return collectives.gather(tensor, self.state)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Sums, averages ("mean"), or takes the "max" or "min" of tensors across processes."""
        return collectives.reduce(tensor, self.state, reduction, scale)

    def broadcast(self, obj: Any, from_process: int = 0) -> Any:
        """Copies tensors, or any picklable object, from `from_process` to all processes."""
        if is_tensor_tree(obj):
            return collectives.broadcast(obj, self.state, from_process)
        return collectives.broadcast_object(obj, self.state, from_process)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pads tensors along `dim` to the largest size on any process."""
        return collectives.pad_across_processes(tensor, self.state, dim, pad_index, pad_first)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> ContextManager[Any]:
        """A context that yields this process's share of `inputs`."""
        return self.state.split_between_processes(inputs, apply_padding)

    def main_process_first(self) -> ContextManager[None]:
        """Runs the block on the main process first, then on the others (e.g. to download once)."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> ContextManager[None]:
        """Like `main_process_first`, per node (here: globally, which also orders every node)."""
        return self.state.local_main_process_first()

    # ----------------------------------------------------------------- triggers
    def set_trigger(self) -> None:
        """Raises this process's flag, for `check_trigger` (e.g. a loss that became NaN on one rank)."""
        self.__dict__["_trigger"] = True

    def check_trigger(self) -> bool:
        """Whether any process called `set_trigger` since the last check; resets the flags.

        Every process must call it (one all-reduce), so that all of them act on the answer together.
        """
        flag = torch.tensor([1.0 if self.__dict__.pop("_trigger", False) else 0.0], device=self.state.device)
        return bool(self.reduce(flag, reduction="sum").item() > 0)

    # ----------------------------------------------------------------- decorators
    def on_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorates `function` to run on the main process only (it returns None elsewhere)."""
        return self._only_where(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorates `function` to run on each node's main process only."""
        return self._only_where(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """Decorates `function` to run on the last process only."""
        return self._only_where(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None,
                   process_index: int | None = None) -> Callable[..., Any]:
        """Decorates `function` to run on global rank `process_index` only:
        `@accelerator.on_process(process_index=1)`."""
        index = _check_index("process_index", process_index, self.num_processes)
        return self._only_where(function, lambda: self.process_index == index)

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int | None = None) -> Callable[..., Any]:
        """Decorates `function` to run on local rank `local_process_index` of each node only."""
        index = _check_index("local_process_index", local_process_index, self.num_processes)
        return self._only_where(function, lambda: self.local_process_index == index)

    @staticmethod
    def _only_where(function: Callable[..., Any] | None, here: Callable[[], bool]) -> Callable[..., Any]:
        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not callable(fn):
                raise TypeError(f"This decorator wraps a function. Received: {fn!r:.80} ({type(fn).__name__}).")

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs) if here() else None

            return wrapper

        # Used bare (@accelerator.on_main_process) or called (@accelerator.on_process(process_index=1)).
        return decorate if function is None else decorate(function)


class ProcessMethods(ProcessHelpers):
    """The Accelerator's multi-process methods: `ProcessHelpers` and `gather_for_metrics`."""

    gradient_state: GradientState  # what the Accelerator provides

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gathers like `gather`, then drops the samples that even_batches repeated at the end."""
        index, layout = self.state.process_index, getattr(self, "parallelism_config", None)
        rank = index if layout is None else layout.data_parallel_rank(index)
        # A rank whose ready batch (batch_size=None) only pads the last round contributes nothing, nor
        # one that holds the same samples as the first of its tensor-parallel group.
        padding = (layout is not None and layout.repeats_batches(index)) or 0 < self.gradient_state.real_ranks <= rank
        if use_gather_object or not is_tensor_tree(input_data):
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


def _check_index(name: str, value: Any, num_processes: int) -> int:
    return check_non_negative_int(name, value, wanted="a process index, an integer from 0",
                                  fix=f"Use e.g. @accelerator.on_process({name}=0).")


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def _emptied(data: Any) -> Any:
    """`data` with every tensor cut to length 0 along its first dimension (a 0-d one becomes shape (0,))."""
    return map_tensors(lambda t: (t if t.ndim else t[None])[:0], data)


def _truncate(data: Any, length: int) -> Any:
    """The first `length` samples of gathered `data`: of each tensor of a structure, or of a gathered
    list of objects (so not `map_tensors`, which would leave such a list whole)."""
    if isinstance(data, torch.Tensor):
        return data[:length]
    if isinstance(data, dict):
        return type(data)((k, _truncate(v, length)) for k, v in data.items())
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_truncate(v, length) for v in data))
    if isinstance(data, (list, tuple)) and data and all(isinstance(v, torch.Tensor) for v in data):
        return type(data)(_truncate(v, length) for v in data)
    return data[:length]
