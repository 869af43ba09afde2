"""Accelerate's configuration objects for the Accelerator, with the same names and fields.

`Accelerator(dataloader_config=DataLoaderConfiguration(...), gradient_accumulation_plugin=
GradientAccumulationPlugin(...), kwargs_handlers=[DistributedDataParallelKwargs(...),
GradScalerKwargs(...), InitProcessGroupKwargs(...)])` reads them. Every field is either honoured
or refused when the object is built, with an error naming it: none is accepted and then ignored.

Example:
    >>> from fittrain.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
    >>> Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True),
    ...                              InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=5))])
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Any, Iterable

from fittrain.common.checks import check_positive_int
from fittrain.common.reprs import short_repr


def _check(owner: str, name: str, value: Any, kind: type | tuple[type, ...], hint: str = "") -> None:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        ok = False
    else:
        ok = isinstance(value, kind)
    if not ok:
        wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"`{owner}({name}=...)` must be a {wanted}. Received: {name}={value!r:.80} "
                        f"({type(value).__name__}).{hint}")


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How `prepare` shares dataloaders between processes.

    Attributes:
        split_batches: Split each loader batch across processes (the batch size is the global
            one) instead of giving each process whole batches.
        dispatch_batches: Accelerate's "one process reads, then sends batches" mode; fittrain reads
            on every process (streams included), so only False or None is accepted.
        even_batches: Pad the last round so every process takes the same number of steps.
        use_seedable_sampler: Draw a shuffled loader's order from `data_seed` and the epoch (the
            same on any number of processes, independent of the global RNG) instead of from the
            loader's own generator (False, the default: a plain loop's order).
        data_seed: The seed of that order; None takes torch's initial seed.
        non_blocking: Copy batches to the device asynchronously (with pinned memory).
        use_stateful_dataloader: Accepted for compatibility: fittrain's prepared loaders always
            save and restore their position.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        flags = ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking", "use_stateful_dataloader")
        for name in flags:
            _check("DataLoaderConfiguration", name, getattr(self, name), bool)
        if self.dispatch_batches:
            raise ValueError("`DataLoaderConfiguration(dispatch_batches=True)` is not supported: every fittrain "
                             "process reads its own share of the data (streams too, see docs/concepts.md), so no "
                             "process dispatches batches to the others. Received: dispatch_batches=True. Leave it "
                             "None or False.")
        if self.data_seed is not None:
            _check("DataLoaderConfiguration", "data_seed", self.data_seed, int)


@dataclasses.dataclass
class GradientAccumulationPlugin:
    """How `accumulate()` groups batches into optimizer steps.

    Attributes:
        num_steps: Batches per optimizer step (the Accelerator's `gradient_accumulation_steps`).
        adjust_scheduler: Count the scheduler's calls inside a window as done, as Accelerate does
            (its step counter then matches the batches); the schedule itself advances per real step.
        sync_with_dataloader: Close the window on a loader's last batch, so no gradient is left
            behind; False carries it over into the next pass.
        sync_each_batch: Synchronise gradients on every batch, also inside a window (uses less
            memory under DDP/FSDP, costs a collective per batch; the result is the same).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        check_positive_int("num_steps", self.num_steps, owner="GradientAccumulationPlugin",
                           fix="Pass e.g. GradientAccumulationPlugin(num_steps=4).")
        for name in ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"):
            _check("GradientAccumulationPlugin", name, getattr(self, name), bool)


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for DDP's gradient communication hooks."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs:
    """Arguments for `torch.nn.parallel.DistributedDataParallel` when a model is wrapped.

    The first seven are DDP's own arguments, passed as they are. `comm_hook` compresses or
    approximates the gradients exchanged (fp16, bf16, PowerSGD), `comm_wrapper` compresses a
    PowerSGD hook's traffic, `comm_state_option` configures PowerSGD.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type("comm_hook", self.comm_hook, tuple(DDPCommunicationHookType))
        self.comm_wrapper = _hook_type("comm_wrapper", self.comm_wrapper,
                                       (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16,
                                        DDPCommunicationHookType.BF16))
        for name in ("broadcast_buffers", "find_unused_parameters", "check_reduction", "gradient_as_bucket_view",
                     "static_graph"):
            _check("DistributedDataParallelKwargs", name, getattr(self, name), bool)
        _check("DistributedDataParallelKwargs", "bucket_cap_mb", self.bucket_cap_mb, (int, float))
        _check("DistributedDataParallelKwargs", "comm_state_option", self.comm_state_option, dict)

    def ddp_arguments(self) -> dict[str, Any]:
        """The keyword arguments for DistributedDataParallel."""
        return {name: getattr(self, name) for name in ("dim", "broadcast_buffers", "bucket_cap_mb",
                                                       "find_unused_parameters", "check_reduction",
                                                       "gradient_as_bucket_view", "static_graph")}

    def register_comm_hook(self, model: Any) -> None:
        """Registers the chosen communication hook on a DDP-wrapped `model` (nothing for "no")."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        # Here, so that importing the configuration objects stays light (only a hook needs them).
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
                 DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
                 DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
                 DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
                    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
        hook = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        power = self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
        model.register_comm_hook(state=powerSGD_hook.PowerSGDState(None, **self.comm_state_option) if power else None,
                                 hook=hook)


@dataclasses.dataclass
class GradScalerKwargs:
    """Arguments for the fp16 loss scaler (`torch.amp.GradScaler`)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor"):
            _check("GradScalerKwargs", name, getattr(self, name), (int, float))
        _check("GradScalerKwargs", "growth_interval", self.growth_interval, int)
        _check("GradScalerKwargs", "enabled", self.enabled, bool)

    def scaler_arguments(self) -> dict[str, Any]:
        """The keyword arguments for `torch.amp.GradScaler`."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class InitProcessGroupKwargs:
    """Arguments for `torch.distributed.init_process_group` when the Accelerator joins the group.

    Attributes:
        backend: "gloo" or "nccl"; None picks nccl on CUDA and gloo otherwise.
        init_method: torch's rendezvous URL; None reads torchrun's MASTER_ADDR/MASTER_PORT.
        timeout: How long a collective waits for the other processes.
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in ("gloo", "nccl"):
            raise ValueError(f"`InitProcessGroupKwargs(backend=...)` must be 'gloo', 'nccl' or None. Received: "
                             f"backend={self.backend!r:.80}.")
        if self.init_method is not None:
            _check("InitProcessGroupKwargs", "init_method", self.init_method, str)
        if self.timeout is not None:
            _check("InitProcessGroupKwargs", "timeout", self.timeout, datetime.timedelta,
                   " Pass e.g. timeout=datetime.timedelta(minutes=5).")


@dataclasses.dataclass
class AutocastKwargs:
    """Arguments for `torch.autocast` under mixed precision: `enabled` (False runs the block in full
    precision) and `cache_enabled` (None: torch's default)."""

    enabled: bool = True
    cache_enabled: bool | None = None

    def __post_init__(self) -> None:
        _check("AutocastKwargs", "enabled", self.enabled, bool)
        if self.cache_enabled is not None:
            _check("AutocastKwargs", "cache_enabled", self.cache_enabled, bool)


@dataclasses.dataclass
class ProfileKwargs:
    """Arguments for `accelerator.profile()` (`torch.profiler.profile`).

    Attributes:
        activities: "cpu" and/or "cuda"; default: the CPU, and CUDA when it is available.
        schedule_option: `torch.profiler.schedule`'s arguments (wait, warmup, active, repeat, skip_first).
        on_trace_ready, record_shapes, profile_memory, with_stack, with_flops, with_modules: torch's.
        output_trace_dir: Write a Chrome trace per process there, `PROFILE_PROCESS_{rank}.json`.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules"):
            _check("ProfileKwargs", name, getattr(self, name), bool)
        unknown = [a for a in self.activities or () if a not in ("cpu", "cuda")]
        if unknown:
            raise ValueError(f"`ProfileKwargs(activities=...)` takes 'cpu' and 'cuda'. Received: activities="
                             f"{self.activities!r:.80}.")

    def build(self) -> Any:
        """The `torch.profiler.profile` these arguments describe."""
        # Here, so that importing the configuration objects stays light (only `profile()` needs them).
        import torch
        import torch.profiler as profiler

        names = self.activities or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        kinds = {"cpu": profiler.ProfilerActivity.CPU, "cuda": profiler.ProfilerActivity.CUDA}
        schedule = profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return profiler.profile(activities=[kinds[n] for n in names], schedule=schedule,
                                on_trace_ready=self.on_trace_ready, record_shapes=self.record_shapes,
                                profile_memory=self.profile_memory, with_stack=self.with_stack,
                                with_flops=self.with_flops, with_modules=self.with_modules)


@dataclasses.dataclass
class TorchDynamoPlugin:
    """Accelerate's torch.compile settings: the keyword options of `torch.compile`."""

    backend: Any = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None
    disable: bool = False

    def to_kwargs(self) -> dict[str, Any]:
        """The options to pass to torch.compile (those left at None are torch's defaults)."""
        backend = getattr(self.backend, "value", self.backend)
        options = {"backend": backend.lower() if isinstance(backend, str) else backend, "mode": self.mode,
                   "fullgraph": self.fullgraph, "dynamic": self.dynamic, "options": self.options,
                   "disable": self.disable}
        return {key: value for key, value in options.items() if value is not None}


KWARGS_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs, AutocastKwargs,
                   ProfileKwargs)


def read_kwargs_handlers(handlers: Iterable[Any] | None) -> dict[type, Any]:
    """The handlers of `Accelerator(kwargs_handlers=...)` by type.

    Raises:
        TypeError: for an object of another type, naming it and the accepted ones.
        ValueError: for two handlers of one type.
    """
    found: dict[type, Any] = {}
    for handler in handlers or ():
        if type(handler) not in KWARGS_HANDLERS:
            raise TypeError(f"`kwargs_handlers` takes {', '.join(k.__name__ for k in KWARGS_HANDLERS)} objects. "
                            f"Received: {handler!r:.100} ({type(handler).__name__}).")
        if type(handler) in found:
            raise ValueError(f"`kwargs_handlers` holds two {type(handler).__name__} objects; pass one with all its "
                             "arguments.")
        found[type(handler)] = handler
    return found


def _hook_type(name: str, value: Any, allowed: tuple[DDPCommunicationHookType, ...]) -> DDPCommunicationHookType:
    try:
        kind = DDPCommunicationHookType(value.value if isinstance(value, enum.Enum) else str(value).lower())
    except ValueError:
        kind = None
    if kind not in allowed:
        raise ValueError(f"`DistributedDataParallelKwargs({name}=...)` must be one of "
                         f"{', '.join(repr(k.value) for k in allowed)}. Received: {name}={value!r:.80}.")
    return kind


_RNG_TYPES = ("generator", "torch", "cuda")


@dataclasses.dataclass(frozen=True)
class AcceleratorOptions:
    """What the Accelerator's configuration arguments come to, checked together."""

    data: DataLoaderConfiguration
    accumulation: GradientAccumulationPlugin
    ddp: DistributedDataParallelKwargs | None = None
    scaler: GradScalerKwargs | None = None
    process_group: InitProcessGroupKwargs | None = None
    autocast: AutocastKwargs | None = None
    profile: ProfileKwargs | None = None
    synced_rng: tuple[str, ...] = ()


def resolve_options(split_batches: bool, even_batches: bool, gradient_accumulation_steps: int,
                    dataloader_config: Any, gradient_accumulation_plugin: Any, kwargs_handlers: Any,
                    rng_types: Any) -> AcceleratorOptions:
    """Reads the Accelerator's configuration arguments, refusing what cannot be honoured.

    The plain arguments (`split_batches`, `even_batches`, `gradient_accumulation_steps`) and the
    objects (`dataloader_config`, `gradient_accumulation_plugin`) set the same things: a value
    given both ways must agree.

    Raises:
        TypeError: for an object of the wrong type.
        ValueError: for settings that disagree, or `rng_types` fittrain does not synchronise.
    """
    if dataloader_config is None:
        dataloader_config = DataLoaderConfiguration(split_batches=split_batches, even_batches=even_batches)
    elif not isinstance(dataloader_config, DataLoaderConfiguration):
        raise TypeError(f"`dataloader_config` must be a fittrain.utils.DataLoaderConfiguration or None. Received: "
                        f"{dataloader_config!r:.100} ({type(dataloader_config).__name__}).")
    else:
        for name, value, default in (("split_batches", split_batches, False), ("even_batches", even_batches, True)):
            if value != default and getattr(dataloader_config, name) != value:
                raise ValueError(f"`{name}` is given twice, with different values: {name}={value!r} and "
                                 f"dataloader_config.{name}={getattr(dataloader_config, name)!r}. Set it in "
                                 "DataLoaderConfiguration only.")
    plugin = gradient_accumulation_plugin
    if plugin is None:
        plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
    elif not isinstance(plugin, GradientAccumulationPlugin):
        raise TypeError(f"`gradient_accumulation_plugin` must be a fittrain.utils.GradientAccumulationPlugin or "
                        f"None. Received: {plugin!r:.100} ({type(plugin).__name__}).")
    elif gradient_accumulation_steps != 1:
        raise ValueError("Pass either `gradient_accumulation_steps` or `gradient_accumulation_plugin`, not both. "
                         f"Received: gradient_accumulation_steps={gradient_accumulation_steps!r} and "
                         f"gradient_accumulation_plugin={plugin!r}. Set num_steps in the plugin.")
    synced = _check_rng_types(rng_types)
    handlers = read_kwargs_handlers(kwargs_handlers)
    return AcceleratorOptions(dataloader_config, plugin, handlers.get(DistributedDataParallelKwargs),
                              handlers.get(GradScalerKwargs), handlers.get(InitProcessGroupKwargs),
                              handlers.get(AutocastKwargs), handlers.get(ProfileKwargs), synced)


def _check_rng_types(rng_types: Any) -> tuple[str, ...]:
    """Accelerate's `rng_types`: "generator" (its default) is what fittrain always does; "torch" and
    "cuda" are synchronised at the start of every pass of a prepared loader. Returns those two."""
    if rng_types is None:
        return ()
    if isinstance(rng_types, (str, bytes)) or not isinstance(rng_types, (list, tuple)):
        raise TypeError(f"`rng_types` must be a list of names such as ['generator'], or None. Received: "
                        f"rng_types={rng_types!r:.80}.")
    names = [getattr(r, "value", r) for r in rng_types]
    unknown = [n for n in names if n not in _RNG_TYPES]
    if unknown:
        raise ValueError(f"`rng_types` holds {unknown!r}, which fittrain does not synchronise. Received: "
                         f"rng_types={names!r}. Use 'generator' (every prepared loader draws its order from process "
                         "0's random state), 'torch' and 'cuda' (process 0's global generators are copied to every "
                         "process at the start of each pass), or None.")
    return tuple(n for n in names if n != "generator")


def check_fsdp_classes(classes: Any) -> tuple[type, ...] | None:
    """`Accelerator(fsdp_classes=...)` as a tuple of nn.Module subclasses (None or empty: None)."""
    import torch.nn  # here, so that importing the configuration objects stays light

    def is_module_class(item: Any) -> bool:
        return isinstance(item, type) and issubclass(item, torch.nn.Module)

    if is_module_class(classes):
        return (classes,)  # one class, given without a list
    if classes is None:
        return None
    if isinstance(classes, (list, tuple, set, frozenset)) and all(map(is_module_class, classes)):
        return tuple(classes) or None
    raise TypeError(f"`fsdp_classes` must be nn.Module subclasses (a list of classes, or one class), the blocks "
                    f"FSDP2 shards one by one. Received: fsdp_classes={short_repr(classes)}. Pass the classes "
                    "themselves, not instances or names: fsdp_classes=[MyBlock], or None to shard every module "
                    "that holds parameters.")


def check_dynamo_plugin(plugin: Any) -> Any:
    """`Accelerator(dynamo_plugin=...)`: a `TorchDynamoPlugin` or None, returned as given."""
    if plugin is not None and not isinstance(plugin, TorchDynamoPlugin):
        raise TypeError(f"`dynamo_plugin` must be a fittrain.utils.TorchDynamoPlugin or None. Received: "
                        f"dynamo_plugin={short_repr(plugin)} ({type(plugin).__name__}).")
    return plugin
