"""The Accelerator: Hugging Face Accelerate's vocabulary over plain torch.distributed.

A thin facade. Process facts live in `state`, precision in `precision`, wrappers in `optim`
and `data`, model wrapping in `parallel`, collectives in `collectives` and the checkpoint
layout in `checkpoint`. This class wires them together for one run and keeps no global state;
its multi-process helpers (`process_methods`), checkpoint methods (`checkpoint_methods`) and
experiment trackers (`tracking_methods`) are mixins in modules of their own.

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
import functools
import gc
import os
from typing import Any, ContextManager, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from fittrain.distributed import collectives

from fittrain.distributed import parallel
from fittrain.distributed.collectives import sync_rng_states
from fittrain.data import BatchesShard
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.accelerator.checkpointing import CheckpointMethods, resolve_state_dict_type
from fittrain.step.compile import compile_settings, compile_forward, compile_targets, remove_compiled_forward, uncompiled
from fittrain.data import DataLoaderShard, PositionedSource, SkippedDataLoader, StreamShard
from fittrain.accelerator.compat import CompatMethods
from fittrain.accelerator.configuration import AutocastKwargs, InitProcessGroupKwargs, check_fsdp_classes, resolve_options
from fittrain.data.seedable import with_seedable_sampler
from fittrain.launch.config import dynamo_default, launch_defaults
from fittrain.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from fittrain.step.precision import AutocastForward, check_precision, make_precision
from fittrain.distributed.process_methods import ProcessMethods
from fittrain.distributed.process_state import DistributedType, ProcessState
from fittrain.distributed.gradient_state import GradientState
from fittrain.trackers.registry import resolve_trackers
from fittrain.accelerator.tracking import TrackingMethods

_Scheduler = torch.optim.lr_scheduler.LRScheduler


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}.")
    return value


class Accelerator(ProcessMethods, CheckpointMethods, TrackingMethods, CompatMethods):
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
    """

    def __init__(self, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1, cpu: bool = False,
                 device_placement: bool = True, split_batches: bool = False, even_batches: bool = True,
                 project_dir: str | os.PathLike | None = None, project_config: ProjectConfiguration | None = None,
                 step_scheduler_with_optimizer: bool = True, strategy: str = "auto",
                 fsdp_classes: Iterable[type] | None = None, dynamo_backend: str | None = None,
                 log_with: Any = None, dataloader_config: Any = None, gradient_accumulation_plugin: Any = None,
                 kwargs_handlers: Any = None, rng_types: Any = None, dynamo_plugin: Any = None,
                 state_dict_type: str | None = None) -> None:
        # What `fittrain launch --mixed_precision ...` (or `accelerate launch`) exported fills the defaults.
        mixed_precision, gradient_accumulation_steps, cpu = launch_defaults(mixed_precision,
                                                                            gradient_accumulation_steps, cpu)
        mixed_precision = check_precision(mixed_precision)
        _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        options = resolve_options(split_batches, even_batches, gradient_accumulation_steps, dataloader_config,
                                  gradient_accumulation_plugin, kwargs_handlers, rng_types)
        self.strategy = parallel.resolve_strategy(strategy)
        if project_config is not None and not isinstance(project_config, ProjectConfiguration):
            raise TypeError(
                "`project_config` must be a fittrain.ProjectConfiguration or None. Received: "
                f"project_config={project_config!r:.100} (type {type(project_config).__name__}). For a folder, pass "
                "project_dir=... or project_config=ProjectConfiguration(project_dir=...).")
        if project_dir is not None and not isinstance(project_dir, (str, os.PathLike)):
            raise TypeError(f"`project_dir` must be a str, an os.PathLike or None. Received: project_dir="
                            f"{project_dir!r:.100} (type {type(project_dir).__name__}).")
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None:
            # Accelerate's layout: trackers write {project_dir}/{project_name} unless a logging_dir
            # was given (the Trainer gives its own {project_dir}/logs, where the Logger keeps runs).
            self.project_configuration.set_directories(project_dir)
        group = options.process_group or InitProcessGroupKwargs()
        self.state = ProcessState.from_environment(cpu=cpu, timeout=group.timeout, backend=group.backend,
                                                   init_method=group.init_method, strategy=self.strategy)
        self.state_dict_type = resolve_state_dict_type(state_dict_type, self.strategy, self.state.num_processes)
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
        # torch.compile's keyword options for models prepared from now on; None: no compile.
        backend = dynamo_default(dynamo_backend) if dynamo_plugin is None else dynamo_backend
        self.compile_options: dict[str, Any] | None = compile_settings(backend, dynamo_plugin)
        self.log_with = resolve_trackers(log_with)  # resolved now: a misspelt name fails before training
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PositionedSource] = []
        self._custom_objects: list[Any] = []
        self._replaced_parameters = parallel.ReplacedParameters()

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
        if self._models:
            raise RuntimeError("Set mixed_precision before prepare(): prepared models already use "
                               f"{self.precision.name!r}.")
        self.precision = make_precision(check_precision(value), self.state.device, self._scaler_arguments)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Batches accumulated per optimizer step inside `accumulate()`."""
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.num_steps = _check_positive_int("gradient_accumulation_steps", value)

    @property
    def sync_gradients(self) -> bool:
        """True on batches that end an accumulation window: the optimizer really steps."""
        return self.gradient_state.sync_gradients

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step was skipped because fp16 gradients overflowed: with several prepared
        optimizers, whether any of them skipped its last step (as in Accelerate)."""
        return self.gradient_state.step_was_skipped or any(o.step_was_skipped for o in self._optimizers)

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

    # ----------------------------------------------------------------- prepare
    def prepare(self, *objs: Any) -> Any:
        """Readies models, optimizers, dataloaders and schedulers for this run.

        Models go to the device and into DDP or FSDP2; optimizers and schedulers learn about
        accumulation and precision; dataloaders are sharded and place batches on the device.
        Anything else passes through. Preparing an object twice returns it unchanged.

        Returns:
            The prepared objects in the order given (a single object when one was given).
        """
        prepared = list(objs)
        for i, obj in enumerate(objs):
            if isinstance(obj, nn.Module) and not self._is_prepared(obj):
                prepared[i] = self._prepare_model(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, torch.optim.Optimizer) and not self._is_prepared(obj):
                # Also for models prepared by an earlier call: FSDP2 replaced their parameters.
                parallel.rebind_optimizer(obj, self._replaced_parameters.mapping())
                prepared[i] = self._register(self._optimizers, AcceleratedOptimizer(
                    obj, self.gradient_state, self.precision))
            elif isinstance(obj, DataLoader):
                prepared[i] = self.prepare_data_loader(obj)
        for i, obj in enumerate(objs):
            if isinstance(obj, _Scheduler) and not self._is_prepared(obj):
                steps = 1 if self.split_batches else self.num_processes
                prepared[i] = self._register(self._schedulers, AcceleratedScheduler(
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
        shard: PositionedSource
        if isinstance(data_loader, DataLoader) and isinstance(data_loader.dataset, IterableDataset):
            shard = self._prepare_stream(data_loader, place, even)
        elif not isinstance(data_loader, DataLoader):
            shard = BatchesShard(data_loader, self.device if place else None, self.gradient_state,
                                 self.num_processes, self.process_index, even)
            self._check_same_length(len(data_loader), "batches")
        else:
            if self.dataloader_config.use_seedable_sampler:
                data_loader = with_seedable_sampler(data_loader, self.dataloader_config.data_seed)
            # Every pass draws the user's order from rank 0's RNG state, broadcast once per epoch.
            shard = DataLoaderShard(data_loader, self.device if place else None, self.gradient_state,
                                    self.num_processes, self.process_index, self.split_batches, even,
                                    share=lambda obj: collectives.broadcast_object(obj, self.state))
            self._check_same_length(*shard.length_check)
        # Pinned memory copies asynchronously anyway; DataLoaderConfiguration(non_blocking=True) always.
        shard._non_blocking = shard._non_blocking or self.dataloader_config.non_blocking
        shard.resumes_itself = self.dataloader_config.use_stateful_dataloader
        if self._synced_rng:  # Accelerate's rng_types=["torch", "cuda"]: process 0's generators at each pass
            shard.sync_rng = functools.partial(sync_rng_states, self._synced_rng, self.state)
        return self._register(self._dataloaders, shard)

    def _check_same_length(self, length: int, unit: str) -> None:
        """Checks that every process passed a loader of the same length.

        One small collective at prepare time. Loaders of different lengths would give the processes
        different numbers of batches, and the first process to run out would leave the others
        waiting in a collective until the timeout, so every process raises the same error instead.
        """
        lengths = collectives.gather_object(length, self.state)
        if len(set(lengths)) > 1:
            listed = ", ".join(f"process {rank}: {n} {unit}" for rank, n in enumerate(lengths))
            raise ValueError(
                f"The data loaders prepared on different processes have different lengths ({listed}). Every "
                "process must pass the same, whole dataset: fittrain gives each process its share. Build the "
                "dataset identically on every process (same files, same filtering, same seed).")

    def _is_prepared(self, obj: Any) -> bool:
        pools: list[list[Any]] = [self._models, self._optimizers, self._schedulers, self._dataloaders]
        return any(obj is p for pool in pools for p in pool)

    @staticmethod
    def _register(pool: list[Any], obj: Any) -> Any:
        pool.append(obj)
        return obj

    def _prepare_stream(self, loader: DataLoader, place: bool, even: bool) -> StreamShard:
        if self.split_batches:
            raise ValueError(
                "`split_batches=True` cannot split the batches of a stream (a DataLoader over an IterableDataset): "
                f"received one over {type(loader.dataset).__name__}. Use split_batches=False (the default); every "
                "process then takes whole batches of the loader's batch_size.")
        return StreamShard(loader, self.device if place else None, self.gradient_state, self.num_processes,
                           self.process_index, even, agree=self._all_agree)

    def _all_agree(self, flag: bool) -> bool:
        """True on every process when `flag` is True on every process (one small all-reduce)."""
        total = collectives.reduce(torch.tensor([int(flag)], device=self.device), self.state)
        return int(total.item()) == self.num_processes

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if self.device_placement:
            model = model.to(self.device)
        before = list(parallel.unwrap(model).named_parameters())  # names as unwrap gives them after
        wrapped = parallel.wrap_model(model, self.state, self.strategy, self.fsdp_classes, self.ddp_handler)
        after = dict(parallel.unwrap(wrapped).named_parameters())
        # FSDP2 swaps parameters for sharded ones; optimizers built earlier must follow them.
        for name, old in before:
            if name in after and after[name] is not old:
                self._replaced_parameters.record(old, after[name])
        if self.compile_options is not None:
            # Inside the precision wrapper, which then autocasts around the compiled code.
            for target in compile_targets(parallel.unwrap(wrapped)):
                compile_forward(target, self.compile_options)
        self.precision.wrap_forward(wrapped)
        return self._register(self._models, wrapped)

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
            stack.enter_context(parallel.no_sync(model))
        return stack

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """A context in which backward does not synchronise `model`'s gradients across processes."""
        return parallel.no_sync(model)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Divides fp16 gradients by the loss scale (once per step); a no-op otherwise."""
        targets = [optimizer] if optimizer is not None else self._optimizers
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
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamps every gradient element to [-clip_value, clip_value], after unscaling."""
        if self.gradient_state.sync_gradients:
            self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(list(parameters), clip_value)

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
        if not keep_fp32_wrapper:
            for candidate in (model, parallel.unwrap(model)):
                forward = candidate.__dict__.get("forward")
                if isinstance(forward, AutocastForward):
                    # A compiled forward under the wrapper stays; the class's own forward needs no attribute.
                    if getattr(forward.original, "__self__", None) is candidate:
                        del candidate.forward
                    else:
                        candidate.forward = forward.original
        if not keep_torch_compile:
            self._remove_compile(parallel.unwrap(model))
        return parallel.unwrap(model)

    @staticmethod
    def _remove_compile(model: nn.Module) -> None:
        for module in model.modules():  # under FSDP2 each sharded unit was compiled
            forward = module.__dict__.get("forward")
            if isinstance(forward, AutocastForward):  # the fp32 wrapper stays, around the plain forward
                forward.original = uncompiled(forward.original)
            else:
                remove_compiled_forward(module)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """One pass of a prepared loader that starts after `num_batches` batches, loading none of them."""
        if isinstance(dataloader, SkippedDataLoader):
            dataloader = dataloader.loader
        if not isinstance(dataloader, PositionedSource):
            raise TypeError("skip_first_batches() takes a DataLoader returned by prepare(). "
                            f"Received: {type(dataloader).__name__}. Prepare it first.")
        return SkippedDataLoader(dataloader, num_batches)

    # ----------------------------------------------------------------- teardown
    def free_memory(self, *objects: Any) -> list[None]:
        """Forgets prepared objects and frees cached device memory (and the CPU copy that async
        checkpoints keep, once a write in flight is done).

        Returns:
            A list of None, one per object, to rebind the caller's names to.
        """
        self.wait_for_checkpoint()
        if self._background_checkpoints is not None:
            self._background_checkpoints.release_buffers()
        for pool in (self._models, self._optimizers, self._schedulers, self._dataloaders):
            pool.clear()
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
            self._finish_trackers()
            if self._background_checkpoints is not None:
                self._background_checkpoints.close()
        finally:
            self.state.shutdown()

