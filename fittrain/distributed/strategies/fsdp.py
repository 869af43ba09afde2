"""`FSDP2Strategy`: each process holds a shard of every parameter (`torch.distributed.fsdp.fully_shard`).

Checkpoints hold full, unsharded state unless `state_dict_type="sharded"`: `full_state_dict` and
`optimizer_state_dict` gather it from the shards (every rank must call them), and
`load_full_state_dict` and `load_optimizer_state_dict` shard it again. On one process nothing is
sharded (prepare warns), and every method behaves as the base `Strategy`'s.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Iterable, Iterator, Sequence

import torch
from torch import nn

from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies.base import Strategy
from fittrain.distributed.strategies.parameters import inner_optimizer, rekeyed, set_hyperparameters
from fittrain.distributed.wrappers import is_fsdp, unwrap


class FSDP2Strategy(Strategy):
    """Shards models with FSDP2's `fully_shard`, innermost units first.

    Args:
        state: This process's place in the run.
        fsdp_classes: Module classes to shard; default: every module that holds parameters
            directly. The root is always sharded last.
        mesh: The device mesh's (shape, dimension names): 1-D shards over every process; 2-D,
            (replicate, shard), is HSDP (`fittrain.distributed.layout`). Default: 1-D.
    """

    shards_parameters = True

    def __init__(self, state: ProcessState, fsdp_classes: tuple[type, ...] | None = None,
                 mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None) -> None:
        super().__init__(state)
        self.fsdp_classes = fsdp_classes
        self.mesh_shape, self.mesh_dim_names = mesh or ((state.num_processes,), ("dp_shard",))
        # The whole run's mesh: FSDP2's own here; a strategy that adds dimensions widens it.
        self._world: tuple[tuple[int, ...], tuple[str, ...]] = (self.mesh_shape, self.mesh_dim_names)
        self._mesh: Any = None

    def device_mesh(self) -> Any:
        """The run's `DeviceMesh`, built at the first wrap and shared by every model (each build makes
        new process groups); None on one process, which shards nothing."""
        if self._mesh is None and self.state.is_distributed:
            from torch.distributed.device_mesh import init_device_mesh  # FSDP2's modules load only when sharding

            shape, names = self._world
            self._mesh = init_device_mesh(self.state.device.type, shape, mesh_dim_names=names)
        return self._mesh

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.state.is_distributed:
            # stacklevel 5 points past _wrap, wrap, the Accelerator's _prepare_model and prepare at the user's line.
            warnings.warn("strategy='fsdp' needs more than one process, and this run has one: the model trains "
                          "unsharded on a single process. Launch with `fittrain launch --num_processes N` (or "
                          "torchrun) to shard it.", UserWarning, stacklevel=5)
            return model
        # A 2-D (replicate, shard) mesh makes fully_shard shard within each replica group and average
        # gradients across the groups: HSDP.
        return self._shard(model, self.device_mesh())

    def _shard(self, model: nn.Module, mesh: Any) -> nn.Module:
        """Applies `fully_shard` over `mesh` to `model`'s units and then to `model`."""
        from torch.distributed.fsdp import fully_shard  # FSDP2's modules load only when sharding

        # fully_shard must see inner modules before outer ones, or an outer unit would claim the inner
        # parameters too; modules() lists parents before children, so walk it backwards.
        for child in reversed(list(model.modules())[1:]):
            # By default shard each direct holder of parameters; users may name classes instead.
            wanted = (isinstance(child, self.fsdp_classes) if self.fsdp_classes
                      else any(True for _ in child.parameters(recurse=False)))
            if wanted and not is_fsdp(child):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def compile_targets(self, model: nn.Module) -> list[nn.Module]:
        """The innermost sharded units (the blocks of `fsdp_classes`, by default every module that
        holds parameters), or the model when nothing is sharded.

        FSDP2's hooks gather and free parameters around each unit's forward, and Dynamo does not
        trace them (it breaks the graph there), so a compiled root would be cut into pieces at every
        unit. The hooks run outside each unit's forward, so compiling the innermost units' forwards
        gives whole graphs, as torchtitan compiles each transformer block.
        """
        units = [m for m in model.modules() if is_fsdp(m)]
        if not units:
            return [model]
        return [unit for unit in units if not any(is_fsdp(m) for m in unit.modules() if m is not unit)]

    def holds_shards(self, model: nn.Module) -> bool:
        """Whether `model` (prepared) holds sharded parameters, whose full state every rank gathers."""
        return is_fsdp(self.unwrap(model))

    def hooks_forward(self, model: nn.Module) -> bool:
        return is_fsdp(model)

    def forward_gathers_parameters(self, model: nn.Module) -> bool:
        return self.state.num_processes > 1 and self.holds_shards(model)

    def root_unit_parameters(self, model: nn.Module) -> list[str]:
        # The root's own parameters would be resharded by the first backward while a step that runs
        # several backwards (manual optimization) still uses them.
        if not is_fsdp(model):
            return []
        inner = {id(p) for m in list(model.modules())[1:] if is_fsdp(m) for p in m.parameters()}
        return [name for name, p in model.named_parameters() if id(p) not in inner]

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """FSDP2 skips its reduce-scatter and keeps unsharded gradients."""
        return _no_gradient_sync(model) if is_fsdp(model) else contextlib.nullcontext()

    def join(self, joinables: Sequence[Any]) -> ContextManager[Any] | None:
        # Every FSDP2 forward is a collective: a process that ran out cannot simply stop joining.
        return None if self.state.is_distributed else super().join(joinables)

    # ----------------------------------------------------------------- full state
    def full_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        if not self.holds_shards(model):
            return super().full_state_dict(model, unwrap)
        return gathered_state_dict(self.unwrap(model))

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        if not self.holds_shards(model):
            super().load_full_state_dict(model, state_dict)
            return
        model = self.unwrap(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # see _full_options

        # Sharding scatters one tensor at a time, so every rank must walk the keys in the same
        # order; a dict read by safetensors comes in an order that differs from process to process.
        own = list(model.state_dict())
        ordered = {k: state_dict[k] for k in own if k in state_dict}
        ordered.update((k, state_dict[k]) for k in sorted(state_dict) if k not in ordered)
        set_model_state_dict(model, ordered, options=StateDictOptions(full_state_dict=True))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> dict[str, Any]:
        """Gathered from the shards when `optimizer` trains a sharded model: the main process gets the
        full state, keyed by parameter names, on CPU, and the others an empty dict.

        Raises:
            ValueError: when the optimizer spans several FSDP2 models.
        """
        owner = self._sharded_owner(optimizer, models)
        if owner is None:
            return super().optimizer_state_dict(optimizer, models)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # see _full_options

        return get_optimizer_state_dict(owner, inner_optimizer(optimizer), options=_full_options())

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module],
                                  state_dict: dict[str, Any]) -> None:
        """Shards the full state again; every rank calls it with the full dict.

        Raises:
            ValueError: when the optimizer spans several FSDP2 models.
        """
        owner = self._sharded_owner(optimizer, models)
        if owner is None:
            super().load_optimizer_state_dict(optimizer, models, state_dict)
            return
        state_dict = rekeyed(state_dict, optimizer, [owner], by_name=True)
        if not state_dict.get("state"):
            set_hyperparameters(optimizer, state_dict)  # a stateless optimizer (plain SGD): nothing to shard
            return
        from torch.distributed.checkpoint.state_dict import (  # see _full_options
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(owner, inner_optimizer(optimizer), state_dict,
                                 options=StateDictOptions(full_state_dict=True))

    def streamed_weights(self, model: nn.Module) -> tuple[dict[str, Any], Any] | None:
        """Each rank's shards, made whole one file at a time: no process holds more than one file's
        worth of the model."""
        if not self.holds_shards(model):
            return None
        from fittrain.distributed import sharded_state  # imports torch.distributed.checkpoint: see the base

        return sharded_state.model_state(model), sharded_state.full_tensors


    def _sharded_owner(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> nn.Module | None:
        """The sharded model whose parameters `optimizer` trains, or None when it trains no sharded model.

        Raises:
            ValueError: when the optimizer spans several sharded models.
        """
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [unwrap(m) for m in models if self.holds_shards(m) and any(id(p) in held for p in m.parameters())]
        if len(owners) > 1:
            raise ValueError(
                f"An optimizer that trains {len(owners)} sharded models at once has no single full state dict to "
                "save. Received an optimizer over the parameters of several prepared models; build one optimizer "
                "per model, or wrap the models in one parent nn.Module and prepare that.")
        return owners[0] if owners else None


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2 module on rank 0's CPU (an empty dict elsewhere); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # see _full_options

    return get_model_state_dict(model, options=_full_options())


def _full_options() -> Any:
    # torch.distributed.checkpoint is imported only where FSDP2 state is read or written: importing
    # it costs a noticeable fraction of a second that a run without FSDP2 never pays.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload gathers to the CPU of rank 0 only: the other ranks get an empty dict, which is
    # fine because only the main process writes files, and it spares their memory.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
