"""The Accelerator: Hugging Face Accelerate's vocabulary over plain torch.distributed.

A thin facade that wires one run together and keeps no global state. It owns: the process facts
(`state`), the precision object (`precision`), the strategy that wraps, synchronises, clips and
saves models (`distributed_strategy`), what it prepared (`prepared`), the checkpoint manager
(`checkpointing`) and the trackers (`tracking`); its checkpoint and tracker methods delegate to
those two. Its multi-process helpers come from `ProcessMethods` (shared with `PartialState`),
Accelerate's rarer methods from `CompatMethods`, and data loaders are prepared by `loaders`.

Example:
    >>> accelerator = Accelerator()
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> for inputs, targets in loader:
    ...     optimizer.zero_grad()
    ...     loss = loss_fn(model(inputs), targets)
    ...     accelerator.backward(loss)
    ...     optimizer.step()
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from fittrain.accelerator.checkpointing import Checkpointing, resolve_state_dict_type
from fittrain.accelerator.compat import CompatMethods
from fittrain.accelerator.configuration import (
    AutocastKwargs,
    InitProcessGroupKwargs,
    check_dynamo_plugin,
    check_fsdp_classes,
    resolve_options,
)
from fittrain.accelerator.launch_env import dynamo_default, launch_defaults
from fittrain.accelerator.loaders import prepare_loader
from fittrain.accelerator.prepared import PreparedObjects
from fittrain.accelerator.tracking import Tracking
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.common.checks import check_positive_int
from fittrain.data import PositionedSource, SkippedDataLoader
from fittrain.distributed.gradient_state import GradientState
from fittrain.distributed.layout import ParallelismConfig, check_layout_type
from fittrain.distributed.parallel import resolve_strategy
from fittrain.distributed.process_methods import ProcessMethods
from fittrain.distributed.process_state import DistributedType, ProcessState
from fittrain.distributed.strategies import make_strategy
from fittrain.step.compile import compile_forward, compile_settings, remove_compile
from fittrain.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from fittrain.step.precision import check_precision, make_precision, remove_autocast_forward
from fittrain.trackers.registry import TrackerSpec, resolve_trackers

_Scheduler = torch.optim.lr_scheduler.LRScheduler


class Accelerator(ProcessMethods, CompatMethods):
    """Runs a PyTorch training loop on one or many processes, in mixed precision if asked.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (None means "no"). fp16 also works on CPU.
        gradient_accumulation_steps: Batches per optimizer step inside `accumulate()`.
        cpu: Use the CPU even when an accelerator is present.
        device_placement: Move prepared models and batches to `device`.
        split_batches: Split each loader batch across processes instead of giving each whole batches.
        even_batches: Pad the last round of batches so all processes take the same number of steps.
        project_dir: Root for checkpoints and logs (shortcut for `project_config.project_dir`); unless
            the configuration names a `logging_dir`, it is the logging folder too, as in Accelerate:
            `init_trackers(name)` writes `{project_dir}/{name}`.
        project_config: A `ProjectConfiguration` for checkpoint naming and limits.
        step_scheduler_with_optimizer: Step prepared schedulers only when the optimizer really steps.
        strategy: "auto" or "ddp" (DistributedDataParallel when >1 process) or "fsdp" (FSDP2).
        fsdp_classes: Module classes to wrap with `fully_shard` under "fsdp"; default: every child
            that holds parameters.
        dynamo_backend: A torch.compile backend ("inductor", "eager", "aot_eager", ...; Accelerate's
            upper-case names too) to compile prepared models with; None or "no": no compile. The
            forward is compiled in place, so parameter names and checkpoints stay those of the plain
            model (`fittrain.step.compile`). For other torch.compile options set `compile_options`.
        log_with: Experiment trackers for `init_trackers`/`log`: "all" (Accelerate's: tensorboard, wandb
            and mlflow, those installed), a name ("tensorboard", "csv", "jsonl", "wandb", "mlflow"), a
            `LoggerType`, a tracker instance, or a list (`fittrain.trackers`). Only those are written.
        dataloader_config: Accelerate's `DataLoaderConfiguration` (split_batches, even_batches,
            use_seedable_sampler, data_seed, non_blocking); see `fittrain.accelerator.configuration`.
        gradient_accumulation_plugin: Accelerate's `GradientAccumulationPlugin` (num_steps,
            sync_with_dataloader, sync_each_batch, adjust_scheduler), instead of `gradient_accumulation_steps`.
        kwargs_handlers: `DistributedDataParallelKwargs`, `GradScalerKwargs`, `InitProcessGroupKwargs`.
        rng_types: Accelerate's random generators to synchronise: "generator" (what every prepared
            loader does anyway), "torch" and "cuda" (process 0's global generators are copied to every
            process when a pass of a prepared loader starts).
        dynamo_plugin: Accelerate's `TorchDynamoPlugin` (torch.compile options), instead of `dynamo_backend`.
        state_dict_type: How `save_state` writes models and optimizers: "sharded" (each process
            writes its own shards with torch.distributed.checkpoint; nothing is gathered) or "full"
            (gathered, `model.safetensors`). None: "sharded" under `strategy="fsdp"` on several
            processes, else "full" (or Accelerate's FSDP_STATE_DICT_TYPE variable). `load_state`
            reads either kind, on any number of processes.
        parallelism_config: Accelerate's `ParallelismConfig`: the processes' layout on a device mesh
            (`dp_shard_size` for FSDP2, with `dp_replicate_size` for HSDP), which also picks the
            strategy (`fittrain.distributed.layout`). Its sizes must multiply to the number of processes.
    """

    def __init__(self, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1, cpu: bool = False,
                 device_placement: bool = True, split_batches: bool = False, even_batches: bool = True,
                 project_dir: str | os.PathLike | None = None, project_config: ProjectConfiguration | None = None,
                 step_scheduler_with_optimizer: bool = True, strategy: str = "auto",
                 fsdp_classes: Iterable[type] | None = None, dynamo_backend: str | None = None,
                 log_with: Any = None, dataloader_config: Any = None, gradient_accumulation_plugin: Any = None,
                 kwargs_handlers: Any = None, rng_types: Any = None, dynamo_plugin: Any = None,
                 state_dict_type: str | None = None, parallelism_config: ParallelismConfig | None = None) -> None:
        # What `fittrain launch --mixed_precision ...` (or `accelerate launch`) exported fills the defaults.
        mixed_precision, gradient_accumulation_steps, cpu = launch_defaults(mixed_precision,
                                                                            gradient_accumulation_steps, cpu)
        mixed_precision = check_precision(mixed_precision)
        check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        options = resolve_options(split_batches, even_batches, gradient_accumulation_steps, dataloader_config,
                                  gradient_accumulation_plugin, kwargs_handlers, rng_types)
        #: The strategy's name: "auto", "ddp" or "fsdp" (the launcher's FITTRAIN_STRATEGY fills "auto", and a
        #: parallelism_config's layout decides it).
        requested = resolve_strategy(strategy)
        layout = check_layout_type(parallelism_config)
        self.strategy = layout.strategy if layout is not None and requested == "auto" else requested
        self.project_configuration = _project_configuration(project_dir, project_config)
        group = options.process_group or InitProcessGroupKwargs()
        self.state = ProcessState.from_environment(cpu=cpu, timeout=group.timeout, backend=group.backend,
                                                   init_method=group.init_method, strategy=self.strategy)
        self._scaler_arguments = options.scaler.scaler_arguments() if options.scaler else None
        self.precision = make_precision(mixed_precision, self.state.device, self._scaler_arguments)
        accumulation = options.accumulation
        self.gradient_state = GradientState(num_steps=accumulation.num_steps,
                                            sync_with_dataloader=accumulation.sync_with_dataloader,
                                            adjust_scheduler=accumulation.adjust_scheduler)
        self.gradient_accumulation_plugin = accumulation
        self.dataloader_config = options.data
        self.ddp_handler = options.ddp
        self._autocast_handler = options.autocast
        self.profile_handler = options.profile
        self._synced_rng = options.synced_rng
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.fsdp_classes = check_fsdp_classes(fsdp_classes)
        if layout is not None:  # on every process, before anything is wrapped
            layout.check(self.state.num_processes, requested)
        #: The processes' layout on a device mesh, or None (every process one data-parallel rank).
        self.parallelism_config = layout
        #: Wraps, synchronises, clips and saves models; the only place that knows DDP from FSDP2.
        self.distributed_strategy = make_strategy(self.strategy, self.state, self.fsdp_classes, self.ddp_handler,
                                                  layout)
        # torch.compile's keyword options for models prepared from now on; None: no compile.
        backend = dynamo_default(dynamo_backend) if dynamo_plugin is None else dynamo_backend
        self.compile_options: dict[str, Any] | None = compile_settings(backend, check_dynamo_plugin(dynamo_plugin))
        #: What this Accelerator prepared, in order: what `save_state` covers.
        self.prepared = PreparedObjects()
        self.checkpointing = Checkpointing(
            self.state, self.distributed_strategy, self.prepared, self.gradient_state, self.project_configuration,
            self.precision, resolve_state_dict_type(state_dict_type, self.distributed_strategy.default_state_dict_type))
        # log_with is resolved now: a misspelt tracker name fails before training.
        self.tracking = Tracking(resolve_trackers(log_with), self.project_configuration, self.is_main_process)

    # ----------------------------------------------------------------- facts
    @property
    def distributed_type(self) -> DistributedType:
        """NO, MULTI_CPU, MULTI_GPU or FSDP."""
        return self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        """"no", "fp16" or "bf16"."""
        return self.precision.name

    @mixed_precision.setter
    def mixed_precision(self, value: str | None) -> None:
        if self.prepared.models:
            raise RuntimeError("Set mixed_precision before prepare(): prepared models already use "
                               f"{self.precision.name!r}.")
        self.precision = make_precision(check_precision(value), self.state.device, self._scaler_arguments)
        self.checkpointing.precision = self.precision  # its scaler is saved

    @property
    def gradient_accumulation_steps(self) -> int:
        """Batches accumulated per optimizer step inside `accumulate()`."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = check_positive_int("gradient_accumulation_steps", value)

    @property
    def sync_gradients(self) -> bool:
        """True on batches that end an accumulation window: the optimizer really steps."""
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step was skipped because fp16 gradients overflowed: with several prepared
        optimizers, whether any of them skipped its last step (as in Accelerate)."""
        return self.gradient_state.step_was_skipped or any(o.step_was_skipped for o in self.prepared.optimizers)

    @property
    def project_dir(self) -> str | None:
        """The project's root folder."""
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        """Where loggers write."""
        return self.project_configuration.logging_dir

    @property
    def step(self) -> int:
        """Batches counted by `accumulate()` in the current window."""
        return self.gradient_state.batches_seen

    @property
    def state_dict_type(self) -> str:
        """How `save_state` writes models and optimizers: "full" or "sharded" (read at every save)."""
        return self.checkpointing.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, value: str) -> None:
        self.checkpointing.state_dict_type = value

    @property
    def log_with(self) -> list[TrackerSpec]:
        """The resolved `log_with`: built-in tracker classes and tracker instances."""
        return self.tracking.log_with

    @property
    def trackers(self) -> list[Any]:
        """The trackers `init_trackers` opened (NoOpTrackers on processes other than the main one)."""
        return self.tracking.trackers

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objs: Any) -> Any:
        """Readies models, optimizers, dataloaders and schedulers for this run.

        Models go to the device and into DDP or FSDP2; optimizers and schedulers learn about
        accumulation and precision; dataloaders are sharded and place batches on the device.
        Anything else passes through. Preparing an object twice returns it unchanged.

        Returns:
            The prepared objects in the order given (a single object when one was given).
        """
        prepared, pools = list(objs), self.prepared
        for i, obj in enumerate(objs):
            if isinstance(obj, nn.Module) and not pools.holds(obj):
                prepared[i] = self._prepare_model(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer) and not pools.holds(obj):
                # Also for models prepared by an earlier call: FSDP2 replaced their parameters.
                self.distributed_strategy.rebind_optimizer(obj)
                optimizer = AcceleratedOptimizer(obj, self.gradient_state, self.precision)
                prepared[i] = pools.add(pools.optimizers, optimizer)
            elif isinstance(obj, DataLoader):
                prepared[i] = self.prepare_data_loader(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, _Scheduler) and not pools.holds(obj):
                steps = 1 if self.split_batches else self.num_processes
                prepared[i] = pools.add(pools.schedulers, AcceleratedScheduler(
                    obj, self.gradient_state, self.step_scheduler_with_optimizer, steps))
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_data_loader(self, data_loader: DataLoader | Any, device_placement: bool | None = None,
                            even_batches: bool | None = None) -> PositionedSource:
        """Prepares one DataLoader, optionally overriding this Accelerator's placement and padding.

        Besides a DataLoader it takes a list (or any re-iterable sized sequence) of ready batches,
        which is iterated as it is: see `fittrain.data.batches`. Evaluation loops may pass
        `even_batches=False` so no sample is repeated.
        """
        if isinstance(data_loader, (PositionedSource, SkippedDataLoader)):
            return data_loader
        place = self.device_placement if device_placement is None else device_placement
        even = self.even_batches if even_batches is None else even_batches
        shard = prepare_loader(self, data_loader, self.device if place else None, even, self._synced_rng)
        return self.prepared.add(self.prepared.dataloaders, shard)

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if self.device_placement:
            model = model.to(self.device)
        strategy = self.distributed_strategy
        wrapped = strategy.wrap(model)
        if self.compile_options is not None:
            # Inside the precision wrapper, which then autocasts around the compiled code.
            for target in strategy.compile_targets(strategy.unwrap(wrapped)):
                compile_forward(target, self.compile_options)
        self.precision.wrap_forward(wrapped)
        return self.prepared.add(self.prepared.models, wrapped)

    # ----------------------------------------------------------------- the step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagates `loss`, averaged over the accumulation window and scaled for fp16."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        self.precision.scale_loss(loss).backward(**kwargs)

    def accumulate(self, *models: nn.Module) -> ContextManager[None]:
        """Marks one batch of an accumulation window; skips gradient sync until its last batch.

        Inside, `sync_gradients` tells whether the optimizer will really step. The window also
        closes on the last batch of a prepared loader.
        """
        self.gradient_state.begin_batch()
        if self.gradient_state.sync_gradients or not models or self.gradient_accumulation_plugin.sync_each_batch:
            # The common case (every sync step, and every step without accumulation) enters no
            # context at all: this runs once per batch, so it must cost next to nothing.
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for model in models:
            stack.enter_context(self.distributed_strategy.no_sync(model))
        return stack

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """A context in which backward does not synchronise `model`'s gradients across processes."""
        return self.distributed_strategy.no_sync(model)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divides fp16 gradients by the loss scale (once per step); a no-op otherwise."""
        targets = [optimizer] if optimizer is not None else self.prepared.optimizers
        for opt in targets:
            self.precision.unscale_(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clips gradients to a total norm of `max_norm`, after unscaling fp16 gradients.

        Returns:
            The total norm of the gradients before clipping.
        """
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        return self.distributed_strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamps every gradient element to [-clip_value, clip_value], after unscaling."""
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        self.distributed_strategy.clip_grad_value_(parameters, clip_value)

    def autocast(self, autocast_handler: Any = None) -> ContextManager[None]:
        """A context for code outside the model that should run in the mixed precision.

        `autocast_handler` (an `AutocastKwargs`, or the one given in `kwargs_handlers`) sets
        `torch.autocast`'s `enabled` and `cache_enabled`.
        """
        handler = autocast_handler if autocast_handler is not None else self._autocast_handler
        if handler is None:
            return self.precision.autocast()  # the per-step path: no arguments to read
        if not isinstance(handler, AutocastKwargs):
            raise TypeError(f"`autocast_handler` must be a fittrain.utils.AutocastKwargs or None. Received: "
                            f"{handler!r:.80} ({type(handler).__name__}).")
        return self.precision.autocast(handler.enabled, handler.cache_enabled)

    # ----------------------------------------------------------------- models
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """Returns the user's module from inside DDP, optionally removing the autocast forward
        (`keep_fp32_wrapper=False`) or the compiled one (`keep_torch_compile=False`), in place."""
        inner = self.distributed_strategy.unwrap(model)
        if not keep_fp32_wrapper:
            for candidate in (model, inner):
                remove_autocast_forward(candidate)
        if not keep_torch_compile:
            for module in inner.modules():  # under FSDP2 each sharded unit was compiled
                remove_compile(module)
        return inner

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """One pass of a prepared loader that starts after `num_batches` batches, loading none of them."""
        if isinstance(dataloader, SkippedDataLoader):
            dataloader = dataloader.loader
        if not isinstance(dataloader, PositionedSource):
            raise TypeError("skip_first_batches() takes a DataLoader returned by prepare(). "
                            f"Received: {type(dataloader).__name__}. Prepare it first.")
        return SkippedDataLoader(dataloader, num_batches)

    # ----------------------------------------------------------------- checkpoints (`Checkpointing`)
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Adds objects whose `state_dict()` travels in every `save_state` (objects with `state_dict` and
        `load_state_dict`). See `Checkpointing.register_for_checkpointing`."""
        self.checkpointing.register_for_checkpointing(*objects)

    def save_state(self, output_dir: str | os.PathLike | None = None, async_save: bool = False,
                   safe_serialization: bool = True, **kwargs: Any) -> str:
        """Saves models, optimizers, schedulers, scaler, RNG, data positions and registered objects
        into one folder, atomically; returns it. See `Checkpointing.save_state`."""
        return self.checkpointing.save_state(output_dir, async_save, safe_serialization, **kwargs)

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True,
                   **kwargs: Any) -> str | None:
        """Restores everything `save_state` saved (the newest intact checkpoint with `input_dir=None`
        and automatic naming; with "auto", that if anything was saved), or changes nothing; returns
        the folder (None for "auto" with nothing saved). See `Checkpointing.load_state`."""
        return self.checkpointing.load_state(input_dir, strict, **kwargs)

    def wait_for_checkpoint(self) -> None:
        """Blocks until the checkpoint `save_state(async_save=True)` is writing is complete; raises its error."""
        self.checkpointing.wait_for_checkpoint()

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (gathered from every rank under FSDP2; call it on all).

        With `unwrap=False` the keys are those of the wrapped model (DDP's `module.` prefix).
        """
        return self.checkpointing.get_state_dict(model, unwrap)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Writes the unwrapped model's weights as safetensors (sharded past `max_shard_size`); every
        process calls it under FSDP2. See `Checkpointing.save_model`."""
        self.checkpointing.save_model(model, save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Saves `obj` with torch.save (or safetensors) from the main process only."""
        self.checkpointing.save(obj, f, safe_serialization)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Registers `hook(models, weights, output_dir)`, called by `save_state` before it writes.
        See `Checkpointing.register_save_state_pre_hook`."""
        return self.checkpointing.register_save_state_pre_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Registers `hook(models, input_dir)`, called by `load_state` before it reads the models.
        See `Checkpointing.register_load_state_pre_hook`."""
        return self.checkpointing.register_load_state_pre_hook(hook)

    # ----------------------------------------------------------------- trackers (`Tracking`)
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Opens the `log_with` trackers for a run and records `config`. See `Tracking.init_trackers`."""
        self.tracking.init_trackers(project_name, config, init_kwargs)

    def log(self, values: dict[str, Any], step: int | None = None,
            log_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Logs `values` to every tracker (on the main process). See `Tracking.log`."""
        self.tracking.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called `name` (with `unwrap`, its underlying object). See `Tracking.get_tracker`."""
        return self.tracking.get_tracker(name, unwrap)

    # ----------------------------------------------------------------- teardown
    def free_memory(self, *objects: Any) -> list[None]:
        """Forgets prepared objects and frees cached device memory (and the CPU copy that async
        checkpoints keep, once a write in flight is done).

        Returns:
            A list of None, one per object, to rebind the caller's names to.
        """
        self.checkpointing.release_buffers()
        self.prepared.clear()
        self.gradient_state.batches_seen = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    def end_training(self) -> None:
        """Finishes the trackers, waits for a checkpoint still being written, then leaves the process
        group so the script can exit cleanly (also when that write failed, whose error is then raised)."""
        try:
            self.tracking.finish()
            self.checkpointing.close()
        finally:
            self.state.shutdown()


def _project_configuration(project_dir: Any, project_config: Any) -> ProjectConfiguration:
    """`Accelerator(project_config=..., project_dir=...)` checked, as one configuration."""
    if project_config is not None and not isinstance(project_config, ProjectConfiguration):
        raise TypeError(
            "`project_config` must be a fittrain.ProjectConfiguration or None. Received: "
            f"project_config={project_config!r:.100} (type {type(project_config).__name__}). For a folder, pass "
            "project_dir=... or project_config=ProjectConfiguration(project_dir=...).")
    if project_dir is not None and not isinstance(project_dir, (str, os.PathLike)):
        raise TypeError(f"`project_dir` must be a str, an os.PathLike or None. Received: project_dir="
                        f"{project_dir!r:.100} (type {type(project_dir).__name__}).")
    configuration = project_config if project_config is not None else ProjectConfiguration()
    if project_dir is not None:
        # Accelerate's layout: trackers write {project_dir}/{project_name} unless a logging_dir
        # was given (the Trainer gives its own {project_dir}/logs, where the Logger keeps runs).
        configuration.set_directories(project_dir)
    return configuration
