"""Local SGD (Accelerate's `accelerate.local_sgd.LocalSGD`): average the weights every K steps.

Each process takes `local_sgd_steps` optimizer steps on its own gradients, with DDP's gradient
all-reduce switched off (`accelerator.no_sync`), then the processes average their parameters; the
context's exit averages them once more. Communication drops to one all-reduce of the weights
every K steps instead of one of the gradients every step.

It works under DDP (`distributed_type` MULTI_CPU or MULTI_GPU), as Accelerate's does. On one
process there is nothing to average, and it does nothing. FSDP2 shards the parameters, so there
are no whole weights to average: `strategy="fsdp"` is refused by name, on one process too.

Example:
    >>> with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:
    ...     for batch in loader:
    ...         with accelerator.accumulate(model):
    ...             accelerator.backward(model(**batch).loss)
    ...             optimizer.step()
    ...             optimizer.zero_grad()
    ...         local_sgd.step()
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from fittrain.common.checks import check_bool, check_positive_int
from fittrain.distributed.process_state import DistributedType

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator

#: The setups whose parameters are whole on every process (Accelerate's list, as far as fittrain runs).
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    """Runs `local_sgd_steps` updates on each process independently, then averages the parameters.

    Args:
        accelerator: The Accelerator that prepared `model`.
        model: The prepared model whose parameters are averaged.
        local_sgd_steps: Optimizer steps between two averages (call `step()` after each); may be
            None when `enabled` is False.
        enabled: False turns it off: gradients sync every step as usual, nothing is averaged.

    Raises:
        NotImplementedError: under a strategy other than DDP (FSDP2), naming it.
        ValueError: for a `local_sgd_steps` that is not a positive int.
        TypeError: for an `enabled` that is not a bool.
    """

    def __init__(self, accelerator: "Accelerator", model: torch.nn.Module, local_sgd_steps: int | None,
                 enabled: bool = True) -> None:
        check_bool("enabled", enabled, owner="LocalSGD")
        # Disabled, it may have no count: Accelerate's example passes enabled=local_sgd_steps is not None.
        check_positive_int("local_sgd_steps", local_sgd_steps, owner="LocalSGD", optional=not enabled,
                           wanted="a positive integer, the optimizer steps between two averages",
                           fix="Pass e.g. local_sgd_steps=8.")
        kind = accelerator.distributed_type
        # By the strategy's kind too: on one process FSDP2 runs as NO, and the script would only fail on many.
        if kind not in _SUPPORTED or accelerator.distributed_strategy.shards_parameters:
            raise NotImplementedError(
                f"LocalSGD averages whole parameters, which only DDP keeps on every process; this Accelerator runs "
                f"distributed_type={kind.value} (strategy={accelerator.strategy!r}), whose parameters are sharded. "
                "Use Accelerator(strategy='ddp') with LocalSGD, or train without it.")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and kind != DistributedType.NO
        self.num_steps = 0
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            # Gradients stay local until the next average: DDP's all-reduce is what local SGD saves.
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if self.enabled and exc_type is None:
                self._average()  # every process leaves with the same weights
        finally:
            self._no_sync.close()

    def step(self) -> None:
        """Counts an optimizer step, and averages the parameters every `local_sgd_steps` steps."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        """Replaces each parameter with its mean over the processes (one collective call for all)."""
        parameters = [p for p in self.model.parameters()]
        averaged: Any = self.accelerator.reduce([p.detach() for p in parameters], reduction="mean")
        for parameter, mean in zip(parameters, averaged):
            parameter.copy_(mean)
