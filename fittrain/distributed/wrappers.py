"""What a prepared model may be wrapped in, and how to get the user's module back.

DDP wraps a model in `DistributedDataParallel`; FSDP2's `fully_shard` changes the module's class
in place (to a subclass of `FSDPModule`); `torch.compile(model)` returns an `OptimizedModule`.
Only the strategies (`fittrain.distributed.strategies`) ask which of these a model is.
"""

from __future__ import annotations

import sys

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # a torch without FSDP2 has none
    except ImportError:
        return None
    return FSDPModule


def is_fsdp(model: nn.Module) -> bool:
    """Whether `fully_shard` was applied to `model`."""
    fsdp_type = _fsdp_module_type()
    return fsdp_type is not None and isinstance(model, fsdp_type)


def _optimized_module_type() -> type | None:
    # What torch.compile(model) returns. Looked up, never imported: importing torch._dynamo costs
    # about a second, and while nothing imported it no model can have been compiled.
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def unwrap(model: nn.Module) -> nn.Module:
    """Returns the user's module from inside DDP and torch.compile's `OptimizedModule` (FSDP2
    shards in place, so it is already it); its state_dict keys have no `module.` or `_orig_mod.`."""
    optimized = _optimized_module_type()
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif optimized is not None and isinstance(model, optimized):
            model = model._orig_mod
        else:
            return model
