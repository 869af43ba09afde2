"""`TensorParallelStrategy`: layers split between the ranks of a "tp" mesh dimension, then FSDP2.

torchtitan's order on one `DeviceMesh` of (dp_replicate, dp_shard, tp), built once:
1. `parallelize_module` over the innermost "tp" dimension, as the model's `tp_plan` says
   (`tp_plan.py`): the planned layers' weights become DTensors split between the tp ranks, and
   their inputs and outputs are redistributed around them (unless the model came split already,
   from `accelerator.torch_device_mesh["tp"]`);
2. with data parallelism beside it, `fully_shard` over the data-parallel dimensions ("dp_shard",
   or ("dp_replicate", "dp_shard"): HSDP, and replication alone as HSDP with shards of size 1),
   which shards the DTensors further. Without it, the ranks of the one tp group see the same
   batches and nothing else needs averaging.

Everything the FSDP2 strategy does with sharded state applies: full state is gathered from the
DTensors (every rank calls it), sharded checkpoints are DCP's and reshard on load into any layout,
optimizer state is keyed by parameter name. Gradient norms are taken per mesh (`norms.py`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from fittrain.distributed.layout import REPLICATE_DIM, SHARD_DIM, TP_DIM, ParallelismConfig
from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies import norms
from fittrain.distributed.strategies.fsdp import FSDP2Strategy
from fittrain.distributed.strategies.tp_plan import resolve_plan


class TensorParallelStrategy(FSDP2Strategy):
    """Tensor parallelism from the model's `tp_plan`, with FSDP2 over the data-parallel dimensions.

    Args:
        state: This process's place in the run (as many processes as the layout's sizes multiply to).
        layout: A checked `ParallelismConfig` with `tp_size > 1`.
        fsdp_classes: Module classes FSDP2 shards (see `FSDP2Strategy`).
    """

    def __init__(self, state: ProcessState, layout: ParallelismConfig,
                 fsdp_classes: tuple[type, ...] | None = None) -> None:
        super().__init__(state, fsdp_classes, layout.fsdp_mesh)
        self.layout = layout
        # device_mesh() is the whole (dp_replicate, dp_shard, tp) mesh; FSDP2 takes its dp dimensions.
        self._world = ((layout.dp_replicate_size, layout.dp_shard_size, layout.tp_size),
                       (REPLICATE_DIM, SHARD_DIM, TP_DIM))

    def _wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module  # loaded only when parallelizing

        mesh = self.device_mesh()
        # A model whose layers are split already (transformers' from_pretrained(tp_plan="auto",
        # device_mesh=accelerator.torch_device_mesh["tp"]), Accelerate's way) is not split again.
        if not self.holds_shards(model):
            plan = resolve_plan(model, self.layout.tp_size)  # first: a bad plan leaves the model as it was
            # torchtitan's order: split the layers first, so that FSDP2 shards the DTensors they became.
            parallelize_module(model, mesh[TP_DIM], plan)
        if self.layout.data_parallel_size > 1:
            self._shard(model, mesh[self.mesh_dim_names])
        return model

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clips by the total norm over every mesh: the split layers' gradients are DTensors on the tp
        mesh (or FSDP2's), the others not, and torch's own clip refuses such a mix (`norms.py`)."""
        return norms.clip_grad_norm_(parameters, max_norm, norm_type)

    def grad_norm(self, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        return norms.total_norm([p.grad for p in parameters if p.grad is not None], norm_type)

    def holds_shards(self, model: nn.Module) -> bool:
        """Whether any of `model`'s parameters is a DTensor (split by the plan, or sharded by FSDP2)."""
        return any(hasattr(p, "device_mesh") for p in self.unwrap(model).parameters())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dp_replicate={self.layout.dp_replicate_size}, "
                f"dp_shard={self.layout.dp_shard_size}, tp={self.layout.tp_size})")
