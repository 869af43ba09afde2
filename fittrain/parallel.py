"""Model wrapping for data parallelism: DDP or FSDP2, chosen by strategy and world size.

fittrain adds no engine: this module only calls `DistributedDataParallel` and
`torch.distributed.fsdp.fully_shard`, and knows how to undo, pause or read them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .state import ProcessState

STRATEGIES = ("auto", "ddp", "fsdp")


def check_strategy(strategy: Any) -> str:
    """Validates a strategy name.

    Raises:
        ValueError: listing the valid strategies and the value received.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"`strategy` must be one of {', '.join(repr(s) for s in STRATEGIES)}. Received: strategy={strategy!r}."
        )
    return strategy


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def is_fsdp(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model`."""
    fsdp_type = _fsdp_module_type()
    return fsdp_type is not None and isinstance(model, fsdp_type)


def _shard(model: nn.Module, state: ProcessState, classes: tuple[type, ...] | None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(state.device.type, (state.num_processes,))
    for child in list(model.modules())[1:]:
        # By default shard each leaf-most holder of parameters; users may name classes instead.
        wanted = isinstance(child, classes) if classes else any(True for _ in child.parameters(recurse=False))
        if wanted and not is_fsdp(child):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap_model(model: nn.Module, state: ProcessState, strategy: str,
               fsdp_classes: tuple[type, ...] | None = None) -> nn.Module:
    """Wraps `model` for `strategy` when more than one process runs; returns it as is otherwise.

    Args:
        model: A module already on `state.device`.
        state: This process's place in the run.
        strategy: "auto" or "ddp" for DistributedDataParallel, "fsdp" for FSDP2.
        fsdp_classes: Module classes to shard under FSDP2; default: every child holding parameters.

    Returns:
        The wrapped module (DDP), the same module sharded in place (FSDP2), or `model`.
    """
    if not state.is_distributed:
        if strategy == "fsdp":
            warnings.warn("strategy='fsdp' with a single process: training unsharded on one process.",
                          stacklevel=3)
        return model
    if strategy == "fsdp":
        return _shard(model, state, fsdp_classes)
    if not any(p.requires_grad for p in model.parameters()):
        return model  # DDP refuses modules with nothing to train, e.g. a frozen teacher.
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """Returns the user's module from inside DDP (FSDP2 shards in place, so it is already it)."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: nn.Module) -> ContextManager[Any]:
    """A context in which backward accumulates local gradients without communicating."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_fsdp(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's complete state dict on CPU, gathered from shards under FSDP2.

    Under FSDP2 every rank must call this (it communicates).
    """
    model = unwrap(model)
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a complete state dict into the model, sharding it again under FSDP2."""
    model = unwrap(model)
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
        return
    model.load_state_dict(state_dict)


def rebind_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Points `optimizer` at new parameter objects (FSDP2 replaces them with sharded ones).

    Args:
        optimizer: An optimizer built on the plain model, before any step.
        mapping: id(old parameter) -> new parameter.
    """
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


def parameter_slots(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs, used to map parameters before and after sharding."""
    return list(model.named_parameters())
