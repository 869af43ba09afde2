"""Strategies: how models are wrapped, synchronised, clipped and saved across processes.

An Accelerator owns one strategy, built from `strategy=` and the number of processes; no code
outside `fittrain.distributed` asks which one runs (the project's rule: an object, not an `if`).

Holds:
    base         `Strategy`: one process, no wrapper; every method the others override
    ddp          `DDPStrategy`: DistributedDataParallel ("auto" or "ddp" on several processes)
    fsdp         `FSDP2Strategy`: fully_shard ("fsdp"; unsharded, with a warning, on one process); over a
                 2-D (replicate, shard) mesh, HSDP (a `ParallelismConfig`'s layout)
    tensor_parallel  `TensorParallelStrategy`: a `ParallelismConfig` with tp_size > 1: the model's
                 `tp_plan` over the "tp" mesh dimension, then FSDP2 over the data-parallel ones
    tp_plan      a model's `tp_plan` (transformers' names or torch's styles), checked and resolved
    norms        gradient norms and clipping over DTensors on several meshes
    parameters   parameters that wrapping replaced; optimizer states keyed by index or name

Example:
    >>> strategy = make_strategy("fsdp", state, fsdp_classes=(Block,))
    >>> model = strategy.wrap(model)
    >>> with strategy.no_sync(model):
    ...     loss.backward()
"""

from __future__ import annotations

from typing import Any

from fittrain.distributed.layout import ParallelismConfig
from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies.base import Strategy
from fittrain.distributed.strategies.ddp import DDPStrategy
from fittrain.distributed.strategies.fsdp import FSDP2Strategy
from fittrain.distributed.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["DDPStrategy", "FSDP2Strategy", "Strategy", "TensorParallelStrategy", "make_strategy"]


def make_strategy(name: str, state: ProcessState, fsdp_classes: tuple[type, ...] | None = None,
                  ddp_kwargs: Any = None, layout: ParallelismConfig | None = None) -> Strategy:
    """The strategy for a resolved name ("auto", "ddp" or "fsdp") on this run's processes.

    "fsdp" is an `FSDP2Strategy` on one process too, so that what it refuses (LocalSGD) is refused
    before the script runs on many.

    Args:
        name: A name `fittrain.distributed.parallel.resolve_strategy` returned.
        state: This process's place in the run.
        fsdp_classes: For "fsdp": the module classes to shard.
        ddp_kwargs: For DDP: a `DistributedDataParallelKwargs`, or None.
        layout: A checked `ParallelismConfig`, whose mesh FSDP2 shards over (HSDP when 2-D); with
            `tp_size > 1` it decides alone (the name is then its data-parallel part's).
    """
    if layout is not None and layout.tp_size > 1:
        return TensorParallelStrategy(state, layout, fsdp_classes)
    if name == "fsdp":
        return FSDP2Strategy(state, fsdp_classes, layout.fsdp_mesh if layout is not None else None)
    if state.is_distributed:
        return DDPStrategy(state, ddp_kwargs)
    return Strategy(state)
