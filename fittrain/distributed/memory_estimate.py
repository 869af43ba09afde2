"""What each process will hold for a model under a layout, before anything is allocated.

`estimate_memory(model, layout, optimizer="adamw")` counts, for a model built on the meta device
(`with torch.device("meta"): model = MyModel()`, so nothing is allocated), the bytes of
parameters, gradients and optimizer state one process holds under a `ParallelismConfig`:

- tensor parallelism (`tp_size > 1`) first splits the parameters of the layers the model's
  `tp_plan` names, as torch's styles do: a "colwise" Linear's weight and bias by rows, a "rowwise"
  Linear's weight by columns (its bias stays whole), Embeddings the other way round; each rank
  holds `ceil(size / tp_size)` of the split dimension;
- FSDP2 and HSDP then shard every parameter along its first dimension over `dp_shard_size`
  processes, each holding `ceil(rows / dp_shard_size)` rows (FSDP2 pads the last shard to that
  size), whatever `dp_replicate_size` is;
- DDP and one process hold everything;
- gradients are the size of the trainable parameters' shards; optimizer state is a number of
  shard-sized tensors per trainable parameter ("adam"/"adamw": 2, "sgd" with momentum: 1, plain
  "sgd": 0) plus Adam's step counter (a 4-byte tensor per parameter).

With a `sample` batch (meta tensors are fine), it also counts the activations autograd saves for
backward in one forward pass: the tensors saved by the model's operations, parameters excluded.
`fittrain estimate` (fittrain/launch/cli.py) prints the same for a `module:function` that builds
the model. It counts tensors, not the allocator's overhead or the temporary full parameters
FSDP2 gathers for the layer being computed (one layer's worth). Under tensor parallelism the
activations are counted on a copy of the model narrowed to one rank's split layers, which is what
the rank computes with.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import nn

from fittrain.common.reprs import short_repr
from fittrain.distributed.layout import ParallelismConfig

#: Shard-sized state tensors an optimizer keeps per trainable parameter, and whether it keeps a step tensor.
OPTIMIZERS: dict[str, tuple[int, bool]] = {"adam": (2, True), "adamw": (2, True), "sgd": (0, False),
                                           "sgd-momentum": (1, False)}
_STEP_BYTES = 4  # torch's Adam keeps `step` as a float32 scalar tensor per parameter


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one process holds. `activations` is None without a sample batch."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int | None = None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + (self.activations or 0)

    def table(self) -> str:
        """The estimate as aligned lines, in MiB, for the command line."""
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state)]
        rows += [("activations", self.activations)] if self.activations is not None else []
        rows += [("total", self.total)]
        return "\n".join(f"{name:<16} {value / 2**20:>12.3f} MiB" for name, value in rows)


def estimate_memory(model: nn.Module, layout: ParallelismConfig | None = None, optimizer: str = "adamw",
                    sample: Any = None) -> MemoryEstimate:
    """Each process's bytes of parameters, gradients, optimizer state (and activations) for `model`.

    Args:
        model: The model, best built on the meta device.
        layout: The processes' layout; None: one process (or DDP, which holds the same).
        optimizer: "adam", "adamw", "sgd" or "sgd-momentum".
        sample: One process's batch, passed to `model(sample)` to count saved activations; None: not counted.

    Raises:
        ValueError: for an unknown optimizer, a layout with context parallelism (which fittrain does not
            run), or a `tp_size > 1` with a missing or wrong `tp_plan` (`fittrain.distributed.strategies.tp_plan`).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"estimate_memory(optimizer=...) must be one of {', '.join(OPTIMIZERS)}. Received: "
                         f"optimizer={short_repr(optimizer)}. Pick the one whose state matches yours.")
    layout = layout or ParallelismConfig()
    if layout.cp_size > 1:
        raise ValueError(f"estimate_memory covers the layouts fittrain runs: data parallel, FSDP2, HSDP and tensor "
                         f"parallel. Received: cp_size={layout.cp_size}. Use cp_size=1.")
    # Under tensor parallelism a rank holds, and computes with, its split of the planned layers.
    computing = _one_tp_rank(model, layout.tp_size) if layout.tp_size > 1 else model
    params = grads = 0
    trainable = 0
    for parameter in computing.parameters():
        nbytes = _shard_numel(list(parameter.shape), layout.dp_shard_size) * parameter.element_size()
        params += nbytes
        if parameter.requires_grad:
            grads += nbytes
            trainable += 1
    slots, step = OPTIMIZERS[optimizer]
    state = slots * grads + (_STEP_BYTES * trainable if step else 0)
    if sample is None:
        return MemoryEstimate(params, grads, state)
    return MemoryEstimate(params, grads, state, saved_activation_bytes(computing, sample))


def _one_tp_rank(model: nn.Module, tp_size: int) -> nn.Module:
    """A copy of `model` as one tp rank computes: each planned Linear or Embedding narrowed to its
    split (a cheap copy for a model on the meta device)."""
    from fittrain.distributed.strategies.tp_plan import resolve_plan, split_dim

    local = copy.deepcopy(model)
    for name, style in resolve_plan(local).items():
        module = local.get_submodule(name)
        for key, dim in split_dim(module, style).items():
            whole = getattr(module, key)
            shape = list(whole.shape)
            shape[dim] = math.ceil(shape[dim] / tp_size)
            setattr(module, key, nn.Parameter(whole.new_empty(shape), requires_grad=whole.requires_grad))
    return local


def _shard_numel(shape: list[int], shards: int) -> int:
    """Elements of one process's shard: FSDP2's `ceil(rows / shards)` rows (all of a 0-d tensor)."""
    if shards == 1 or not shape:
        return math.prod(shape)
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def saved_activation_bytes(model: nn.Module, sample: Any) -> int:
    """Bytes of the tensors autograd saves for backward in `model(sample)`, parameters excluded.

    Each saved tensor is counted once, by the tensor it is a view of, so that an input saved by two
    operations, or a weight saved transposed, is not counted twice (or at all, for a weight).
    """
    parameters = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in parameters and id(base) not in seen:
            seen.add(id(base))
            total[0] += base.numel() * base.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(sample)
    return total[0]
