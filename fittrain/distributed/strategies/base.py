"""`Strategy`: one process, no wrapper; the base that DDP and FSDP2 override where they differ.

The base does nothing special: `wrap` returns the model, `no_sync` is an empty context, state
dicts are the model's own. Every method takes the prepared objects as they are, so a model the
strategy did not wrap (a frozen teacher, a model prepared with `evaluation_mode=True`) gets the
plain behaviour under any strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Iterable, Sequence

import torch
from torch import nn

from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies.parameters import ReplacedParameters, rebind_optimizer, rekeyed
from fittrain.distributed.wrappers import unwrap


class Strategy:
    """How models are wrapped, synchronised, clipped and saved: here, for one process, plainly.

    Args:
        state: This process's place in the run.
    """

    #: Whether this kind of strategy shards parameters across processes (when several run).
    shards_parameters: ClassVar[bool] = False

    def __init__(self, state: ProcessState) -> None:
        self.state = state
        # FSDP2 swaps parameters for sharded ones; optimizers built earlier must follow them.
        self.replaced_parameters = ReplacedParameters()

    @property
    def is_sharding(self) -> bool:
        """Whether prepared models are sharded: a sharding strategy on several processes."""
        return self.shards_parameters and self.state.is_distributed

    @property
    def default_state_dict_type(self) -> str:
        """How `save_state` writes models when not told: "sharded" while sharding (no rank gathers
        the model), else "full" (one process shards nothing, and there the full format is the
        faster one: benchmarks/checkpoint.py)."""
        return "sharded" if self.is_sharding else "full"

    def device_mesh(self) -> Any:
        """The run's `DeviceMesh`, or None where this strategy uses none (one process, DDP)."""
        return None

    # ----------------------------------------------------------------- wrapping
    def wrap(self, model: nn.Module) -> nn.Module:
        """Wraps `model` (already on the device) for this strategy; records the parameters that
        wrapping replaced, for `rebind_optimizer`.

        Returns:
            The wrapped model (DDP), the same model sharded in place (FSDP2), or `model`.
        """
        before = list(unwrap(model).named_parameters())  # names as unwrap gives them after
        wrapped = self._wrap(model)
        after = dict(unwrap(wrapped).named_parameters())
        for name, old in before:
            if name in after and after[name] is not old:
                self.replaced_parameters.record(old, after[name])
        return wrapped

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside a prepared (or compiled) model."""
        return unwrap(model)

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Points an optimizer built before `wrap` at the parameters wrapping put in place.

        Raises:
            ValueError: when the optimizer already holds state for a replaced parameter.
        """
        rebind_optimizer(optimizer, self.replaced_parameters.mapping())

    def compile_targets(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose forward `torch.compile` compiles: the model itself."""
        return [model]

    # ----------------------------------------------------------------- what the loop asks
    def hooks_forward(self, model: nn.Module) -> bool:
        """Whether calling `model` runs this strategy's work around the user's forward (DDP's
        wrapper, FSDP2's gathering hooks), so that a step must run through `model(...)`."""
        return False

    def forward_gathers_parameters(self, model: nn.Module) -> bool:
        """Whether every forward of `model` gathers parameters from all processes (a collective,
        which every process must join as often as the others)."""
        return False

    def needs_manual_gradient_averaging(self, model: nn.Module) -> bool:
        """Whether a backward that bypassed `model`'s wrapper leaves the gradients local, so that a
        loop calling the module directly (manual optimization) must average them itself."""
        return False

    def root_unit_parameters(self, model: nn.Module) -> list[str]:
        """Names of `model`'s parameters held by its root shard unit only (none when nothing is sharded)."""
        return []

    # ----------------------------------------------------------------- gradients
    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """A context in which backward accumulates local gradients without communicating."""
        return contextlib.nullcontext()

    def trigger_sync_in_backward(self, model: nn.Module) -> ContextManager[Any]:
        """A context in which the next backward of `model` synchronises, also inside `no_sync`."""
        return contextlib.nullcontext()

    def join(self, joinables: Sequence[Any]) -> ContextManager[Any] | None:
        """A context that lets processes with fewer batches finish (torch's `Join`), or None when
        this strategy cannot join `joinables`. One process has nothing to join."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Scales gradients to a total norm of at most `max_norm` (the one clipping path).

        Returns:
            The total norm before clipping, a whole tensor on every process.
        """
        return _whole(torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type))

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamps every gradient element to [-clip_value, clip_value]."""
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

    def grad_norm(self, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of the gradients of `parameters` (those that have one), unchanged."""
        return _whole(torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type))

    # ----------------------------------------------------------------- full state
    def full_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The complete state dict of the user's module (on CPU when gathered from shards).

        Under FSDP2 every rank must call this (it communicates), and only the main process gets the
        tensors. With `unwrap=False` the keys are those of the wrapped model (DDP's `module.`).
        """
        return {k: v.detach() for k, v in self.unwrap(model).state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads a complete state dict (sharding it again under FSDP2, where every rank calls this)."""
        self.unwrap(model).load_state_dict(state_dict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> dict[str, Any]:
        """The optimizer's complete state dict (gathered from shards under FSDP2, keyed by name)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module],
                                  state_dict: dict[str, Any]) -> None:
        """Loads what `optimizer_state_dict` returned, also one keyed by parameter name (FSDP2's)."""
        optimizer.load_state_dict(rekeyed(state_dict, optimizer, models, by_name=False))

    def streamed_weights(self, model: nn.Module) -> tuple[dict[str, Any], Any] | None:
        """This rank's part of `model`'s weights and the function that makes one file's worth of them
        whole, when every rank must take part in writing them (FSDP2); None when the main process
        writes `full_state_dict` alone."""
        return None

    # ----------------------------------------------------------------- sharded state
    # torch.distributed.checkpoint's state_dict API works on any model, sharded or not; imported
    # lazily because it costs a noticeable fraction of a second and only sharded checkpoints need it.
    def sharded_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict as this rank holds it: its shards under FSDP2, all of it otherwise."""
        from fittrain.distributed import sharded_state  # imports torch.distributed.checkpoint: see above

        return sharded_state.model_state(model)

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads `sharded_state_dict`'s form (filled in place by DCP, usually) into the model."""
        from fittrain.distributed import sharded_state  # imports torch.distributed.checkpoint: see above

        sharded_state.load_model_state(model, state_dict)

    def sharded_optimizer_state_dict(self, optimizer: Any, models: Iterable[nn.Module]) -> dict[str, Any]:
        """The optimizer's state as this rank holds it, keyed by parameter name (no gathering)."""
        from fittrain.distributed import sharded_state  # imports torch.distributed.checkpoint: see above

        return sharded_state.optimizer_state(optimizer, models)

    def load_sharded_optimizer_state_dict(self, optimizer: Any, models: Iterable[nn.Module],
                                          state_dict: dict[str, Any]) -> None:
        """Loads `sharded_optimizer_state_dict`'s form into the optimizer."""
        from fittrain.distributed import sharded_state  # imports torch.distributed.checkpoint: see above

        sharded_state.load_optimizer_state(optimizer, models, state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_processes={self.state.num_processes})"


def _whole(norm: torch.Tensor) -> torch.Tensor:
    # Under FSDP2 a norm over sharded gradients is a DTensor; callers record and compare the full value.
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
