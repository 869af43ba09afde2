"""`DDPStrategy`: every process holds the whole model; `DistributedDataParallel` averages gradients.

Used for strategy "auto" or "ddp" when more than one process runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies.base import Strategy


class DDPStrategy(Strategy):
    """Wraps models in `DistributedDataParallel`.

    Args:
        state: This process's place in the run (several processes).
        ddp_kwargs: A `DistributedDataParallelKwargs` (DDP's arguments and communication hook), or None.
    """

    def __init__(self, state: ProcessState, ddp_kwargs: Any = None) -> None:
        super().__init__(state)
        self.ddp_kwargs = ddp_kwargs

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # DDP refuses modules with nothing to train, e.g. a frozen teacher.
        device_ids = [self.state.device.index] if self.state.device.type == "cuda" else None
        if self.ddp_kwargs is None:
            return DistributedDataParallel(model, device_ids=device_ids)
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs.ddp_arguments())
        self.ddp_kwargs.register_comm_hook(wrapped)
        return wrapped

    def hooks_forward(self, model: nn.Module) -> bool:
        return isinstance(model, DistributedDataParallel)

    def needs_manual_gradient_averaging(self, model: nn.Module) -> bool:
        # DDP reduces gradients only for a backward after its own forward.
        return isinstance(model, DistributedDataParallel) and self.state.num_processes > 1

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """DDP skips its all-reduce inside `model.no_sync()`."""
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model: nn.Module) -> ContextManager[Any]:
        """For a loss built from several forwards, all but the last under `no_sync` (contrastive
        losses): DDP then reduces the gradients of this backward."""
        if not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return _synced_backward(model)

    def join(self, joinables: Sequence[Any]) -> ContextManager[Any] | None:
        if not all(isinstance(j, DistributedDataParallel) or hasattr(j, "join_hook") for j in joinables):
            return None
        from torch.distributed.algorithms import Join  # only join_uneven_inputs needs it

        return Join(list(joinables))

    def full_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        full = super().full_state_dict(model)
        if unwrap or not isinstance(model, DistributedDataParallel):
            return full
        return {f"module.{key}": value for key, value in full.items()}


@contextlib.contextmanager
def _synced_backward(model: DistributedDataParallel) -> Iterator[None]:
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])  # what DDP's forward would have done with sync on
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
