"""Model wrapping for data parallelism: DDP or FSDP2, chosen by strategy and world size.

fittrain adds no engine: this module only calls `DistributedDataParallel` and
`torch.distributed.fsdp.fully_shard`, and knows how to undo, pause or read them.

The optimizer rule under FSDP2:
    `fully_shard` replaces every parameter of the model with a sharded `DTensor` parameter, so an
    optimizer must hold the sharded parameters, not the originals. Either build the optimizer
    after `prepare(model)`, on `model.parameters()`, or build it on the plain model before and
    pass it to `prepare` (in the model's call or a later one): prepare then re-binds it to the
    sharded parameters (`rebind_optimizer`, with the replacements `ReplacedParameters` remembers).
    The re-bound optimizer must not have stepped yet, because its state would still belong to the
    old, full-size parameters. DDP keeps the parameters, so under DDP any order works.

    Example:
        >>> optimizer = torch.optim.AdamW(model.parameters())      # plain model: fine
        >>> model, optimizer = accelerator.prepare(model, optimizer)  # re-bound to the shards

Checkpoints hold full, unsharded state: `full_state_dict` and `optimizer_state_dict` gather it
from the shards (every rank must call them under FSDP2), and `load_full_state_dict` and
`load_optimizer_state_dict` shard it again.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from typing import Any, ContextManager, Iterable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fittrain.distributed.process_state import ProcessState

STRATEGIES = ("auto", "ddp", "fsdp")

#: `fittrain launch --strategy X` exports this; `resolve_strategy` honours it for strategy="auto".
STRATEGY_ENV = "FITTRAIN_STRATEGY"


def check_strategy(strategy: Any, source: str = "strategy") -> str:
    """Validates a strategy name.

    Args:
        strategy: The value to check.
        source: How the value was given, for the error message (argument or environment variable).

    Returns:
        `strategy`, unchanged.

    Raises:
        ValueError: listing the valid strategies and the value received.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"`{source}` must be one of {', '.join(repr(s) for s in STRATEGIES)}. Received: {source}={strategy!r}."
        )
    return strategy


def resolve_strategy(strategy: Any) -> str:
    """The strategy to use: `strategy`, or the launcher's FITTRAIN_STRATEGY when it is "auto".

    An explicit argument in the script wins over the launcher, as in Accelerate, where code
    overrides the config file.

    Raises:
        ValueError: when either value is not a valid strategy.
    """
    strategy = check_strategy(strategy)
    from_launcher = os.environ.get(STRATEGY_ENV, "").strip()
    if strategy == "auto" and from_launcher:
        return check_strategy(from_launcher.lower(), STRATEGY_ENV)
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


def _check_fsdp_classes(classes: Sequence[Any]) -> None:
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                "`fsdp_classes` must hold nn.Module subclasses, such as a transformer block class. "
                f"Received: {cls!r}. Pass the class itself, not an instance or its name."
            )


def _shard(model: nn.Module, state: ProcessState, classes: tuple[type, ...] | None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(state.device.type, (state.num_processes,))
    # fully_shard must see inner modules before outer ones, or an outer unit would claim the inner
    # parameters too; modules() lists parents before children, so walk it backwards.
    for child in reversed(list(model.modules())[1:]):
        # By default shard each direct holder of parameters; users may name classes instead.
        wanted = isinstance(child, classes) if classes else any(True for _ in child.parameters(recurse=False))
        if wanted and not is_fsdp(child):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap_model(model: nn.Module, state: ProcessState, strategy: str,
               fsdp_classes: tuple[type, ...] | None = None, ddp_kwargs: Any = None) -> nn.Module:
    """Wraps `model` for `strategy` when more than one process runs; returns it as is otherwise.

    Args:
        model: A module already on `state.device`.
        state: This process's place in the run.
        strategy: "auto" or "ddp" for DistributedDataParallel, "fsdp" for FSDP2.
        fsdp_classes: Module classes to shard under FSDP2; default: every module that holds
            parameters directly. The root is always sharded last.
        ddp_kwargs: A `DistributedDataParallelKwargs` (DDP's arguments and communication hook), or None.

    Returns:
        The wrapped module (DDP), the same module sharded in place (FSDP2), or `model`.

    Raises:
        ValueError: when `fsdp_classes` holds something other than nn.Module subclasses.
    """
    if fsdp_classes:
        _check_fsdp_classes(fsdp_classes)
    if not state.is_distributed:
        if strategy == "fsdp":
            # stacklevel 4 points past prepare() at the user's line.
            warnings.warn("strategy='fsdp' needs more than one process, and this run has one: the model trains "
                          "unsharded on a single process. Launch with `fittrain launch --num_processes N` (or "
                          "torchrun) to shard it.", UserWarning, stacklevel=4)
        return model
    if strategy == "fsdp":
        return _shard(model, state, fsdp_classes)
    if not any(p.requires_grad for p in model.parameters()):
        return model  # DDP refuses modules with nothing to train, e.g. a frozen teacher.
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    if ddp_kwargs is None:
        return DistributedDataParallel(model, device_ids=device_ids)
    wrapped = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs.ddp_arguments())
    ddp_kwargs.register_comm_hook(wrapped)
    return wrapped


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


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: nn.Module) -> ContextManager[Any]:
    """A context in which backward accumulates local gradients without communicating.

    DDP skips its all-reduce; FSDP2 skips its reduce-scatter and keeps unsharded gradients.
    """
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_fsdp(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


def _full_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload gathers to the CPU of rank 0 only: the other ranks get an empty dict, which is
    # fine because only the main process writes files, and it spares their memory.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's complete state dict on CPU, gathered from shards under FSDP2.

    Under FSDP2 every rank must call this (it communicates), and only the main process gets
    the tensors; the others get an empty dict.
    """
    model = unwrap(model)
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_full_options())
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Loads a complete state dict into the model, sharding it again under FSDP2.

    Under FSDP2 every rank must call this with the full dict (each keeps its own shard).
    """
    model = unwrap(model)
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Sharding scatters one tensor at a time, so every rank must walk the keys in the same
        # order; a dict read by safetensors comes in an order that differs from process to process.
        own = list(model.state_dict())
        ordered = {k: state_dict[k] for k in own if k in state_dict}
        ordered.update((k, state_dict[k]) for k in sorted(state_dict) if k not in ordered)
        set_model_state_dict(model, ordered, options=StateDictOptions(full_state_dict=True))
        return
    model.load_state_dict(state_dict)


def _fsdp_owner(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> nn.Module | None:
    """The FSDP2 model whose parameters `optimizer` trains, or None when it trains no sharded model.

    Raises:
        ValueError: when the optimizer spans several FSDP2 models, which has no single full state.
    """
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in map(unwrap, models) if is_fsdp(m) and any(id(p) in held for p in m.parameters())]
    if len(owners) > 1:
        raise ValueError(
            f"An optimizer that trains {len(owners)} FSDP2 models at once has no single full state dict to "
            "save. Received an optimizer over the parameters of several prepared models; build one optimizer "
            "per model, or wrap the models in one parent nn.Module and prepare that."
        )
    return owners[0] if owners else None


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # torch.distributed.checkpoint may run a zero-lr step to create missing state; it must reach
    # the real optimizer, not AcceleratedOptimizer, whose step() skips inside accumulation windows.
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_state_dict(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> dict[str, Any]:
    """The optimizer's complete state dict, gathered from shards when it trains an FSDP2 model.

    Under FSDP2 every rank must call this (it communicates); the main process gets the full state,
    keyed by parameter names, on CPU, and the others get an empty dict. Otherwise it is
    `optimizer.state_dict()`.

    Args:
        optimizer: A prepared optimizer (or the plain one it wraps).
        models: The prepared models; the one whose parameters the optimizer holds is used.

    Raises:
        ValueError: when the optimizer spans several FSDP2 models.
    """
    owner = _fsdp_owner(optimizer, models)
    if owner is None:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(owner, _inner(optimizer), options=_full_options())


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, models: Iterable[nn.Module],
                              state_dict: dict[str, Any]) -> None:
    """Loads what `optimizer_state_dict` returned, sharding it again under FSDP2.

    Under FSDP2 every rank must call this with the full dict, as read from the checkpoint.

    Args:
        optimizer: A prepared optimizer (or the plain one it wraps).
        models: The prepared models.
        state_dict: The full optimizer state.

    Raises:
        ValueError: when the optimizer spans several FSDP2 models.
    """
    owner = _fsdp_owner(optimizer, models)
    if owner is None:
        optimizer.load_state_dict(_rekeyed(state_dict, optimizer, models, by_name=False))
        return
    state_dict = _rekeyed(state_dict, optimizer, [owner], by_name=True)
    if not state_dict.get("state"):
        # A stateless optimizer (plain SGD) has nothing to shard, and torch's loader cannot tell the
        # device of an empty state: set the groups' hyperparameters (lr, ...) directly, in order.
        for group, saved in zip(_inner(optimizer).param_groups, state_dict.get("param_groups", ())):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(owner, _inner(optimizer), state_dict, options=StateDictOptions(full_state_dict=True))


def _rekeyed(state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, models: Iterable[nn.Module],
             by_name: bool) -> dict[str, Any]:
    """The optimizer state keyed as the live optimizer loads it: by parameter name under FSDP2, by
    index otherwise. A run resumed on another number of processes may get the other kind: FSDP2
    shards nothing on one process, whose full optimizer state is keyed by index.

    Indices count the optimizer's parameters in its groups' order; names are the unwrapped
    model's parameter names. A state that cannot be mapped is returned unchanged (torch's own
    loader then says what is wrong).
    """
    params = [p for group in _inner(optimizer).param_groups for p in group["params"]]
    names = {id(p): name for model in models for name, p in unwrap(model).named_parameters()}
    keys = [names.get(id(p)) for p in params]
    saved = state_dict.get("state", {})
    if None in keys or not all(isinstance(k, int if by_name else str) for k in saved):
        return state_dict
    old_to_new = dict(enumerate(keys)) if by_name else {name: i for i, name in enumerate(keys)}
    try:
        return {**state_dict, "state": {old_to_new[k]: v for k, v in saved.items()},
                "param_groups": [{**group, "params": [old_to_new[k] for k in group["params"]]}
                                 for group in state_dict["param_groups"]]}
    except (KeyError, TypeError):
        return state_dict


class ReplacedParameters:
    """The parameters that wrapping replaced (FSDP2 shards them), remembered across prepare() calls.

    Both sides are weak references: an entry matters only while something, such as an optimizer
    built on the plain model, still holds the old parameter, and it must not keep either alive.
    A weak reference also guards against a reused `id`: a dead entry never matches.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def record(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """Notes that `new` replaced `old`."""
        self._entries[id(old)] = (weakref.ref(old), weakref.ref(new))

    def mapping(self) -> dict[int, nn.Parameter]:
        """id(old parameter) -> new parameter, for the entries whose both sides are still alive."""
        live: dict[int, nn.Parameter] = {}
        for key, (old, new) in list(self._entries.items()):
            replacement = new()
            if old() is None or replacement is None:
                del self._entries[key]
            else:
                live[key] = replacement
        return live


def rebind_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Points `optimizer` at new parameter objects (FSDP2 replaces them with sharded ones).

    See the module docstring for the rule this serves.

    Args:
        optimizer: An optimizer built on the plain model, before any step.
        mapping: id(old parameter) -> new parameter.

    Raises:
        ValueError: when the optimizer already holds state for a parameter being replaced.
    """
    stale = [p for p in optimizer.state if id(p) in mapping]
    if stale:
        raise ValueError(
            "prepare() re-binds an optimizer built before it to the sharded FSDP2 parameters, but this "
            f"optimizer has already stepped (it holds state for {len(stale)} parameters), and that state "
            "belongs to the unsharded ones. Received an optimizer with state; prepare it before its first step, "
            "or build it after prepare(model) on model.parameters()."
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
