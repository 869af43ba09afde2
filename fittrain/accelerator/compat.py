"""Accelerate's Accelerator methods that user scripts call and fittrain's own loop does not need.

`CompatMethods`, a base class of `Accelerator`, kept apart so the facade stays short:
`prepare_model`/`prepare_optimizer`/`prepare_scheduler` (one kind each, through `prepare`),
`trigger_sync_in_backward` (a loss built from several forwards under `no_sync`),
`join_uneven_inputs` (DDP's Join for loaders of different lengths), `profile`, and read-only
views of the configuration (`split_batches`, `use_seedable_sampler`, `is_fsdp2`, ...). It reads
only the Accelerator's public attributes, declared below.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from fittrain.accelerator.configuration import DataLoaderConfiguration, ProfileKwargs
from fittrain.accelerator.prepared import PreparedObjects
from fittrain.checkpoint.naming import ProjectConfiguration
from fittrain.data import BatchesShard, StreamShard
from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies import Strategy
from fittrain.step.precision import FullPrecision


class CompatMethods:
    """Accelerate's less common Accelerator methods, on the Accelerator's public attributes."""

    # The Accelerator's attributes and method these methods use (it sets each in __init__).
    prepare: Callable[..., Any]
    state: ProcessState
    precision: FullPrecision
    device_placement: bool
    distributed_strategy: Strategy
    prepared: PreparedObjects
    dataloader_config: DataLoaderConfiguration
    profile_handler: ProfileKwargs | None
    project_configuration: ProjectConfiguration

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Prepares one model, as `prepare(model)` does.

        Args:
            model: The model.
            device_placement: Overrides the Accelerator's `device_placement` for this model.
            evaluation_mode: Only move the model to the device (and autocast it), without DDP or
                FSDP: for a model that is only evaluated.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare_model() takes a torch.nn.Module. Received: {type(model).__name__}.")
        placement = self.device_placement if device_placement is None else device_placement
        if evaluation_mode:
            model = model.to(self.state.device) if placement else model
            self.precision.wrap_forward(model)
            return model
        saved, self.device_placement = self.device_placement, placement
        try:
            return self.prepare(model)
        finally:
            self.device_placement = saved

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Prepares one optimizer, as `prepare(optimizer)` does (its state follows its parameters)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"prepare_optimizer() takes a torch.optim.Optimizer. Received: {type(optimizer).__name__}.")
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Prepares one LR scheduler, as `prepare(scheduler)` does."""
        schedulers = torch.optim.lr_scheduler
        if not isinstance(scheduler, (schedulers.LRScheduler, schedulers.ReduceLROnPlateau)):
            raise TypeError(f"prepare_scheduler() takes a torch LR scheduler. Received: {type(scheduler).__name__}.")
        return self.prepare(scheduler)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Makes the next backward of `model` synchronise gradients, also inside `no_sync`.

        For a loss built from several forwards, all but the last of which ran under `no_sync`
        (contrastive losses): DDP then reduces the gradients of this backward. Elsewhere (one
        process, FSDP2, which syncs per backward anyway) it does nothing.
        """
        with self.distributed_strategy.trigger_sync_in_backward(model):
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Lets processes with fewer batches finish while the others train (torch's `Join`).

        Args:
            joinables: DDP models (and other `torch.distributed.algorithms.Joinable` objects).
            even_batches: Overrides `even_batches` of the prepared loaders inside the block; pass
                False so that each process really sees only its own share.
        """
        if even_batches is not None and any(isinstance(loader, StreamShard) for loader in self.prepared.dataloaders):
            warnings.warn("Overriding even_batches is only supported for map-style datasets (a DataLoader over a "
                          "Dataset, or a list of batches); the prepared loaders over an IterableDataset keep "
                          "padding their last round, so every process takes the same number of steps.",
                          UserWarning, stacklevel=3)
        with self._even_batches_as(even_batches):
            join = self.distributed_strategy.join(joinables)
            if join is None:
                warnings.warn("join_uneven_inputs() works with DDP models (torch.distributed.algorithms.Join); "
                              "with FSDP2 or other objects the block runs without it, so uneven loaders may hang. "
                              "Use even_batches=True instead.", stacklevel=3)
                yield
            else:
                with join:
                    yield

    @contextlib.contextmanager
    def _even_batches_as(self, even_batches: bool | None) -> Iterator[None]:
        if even_batches is None:
            yield
            return
        if not isinstance(even_batches, bool):
            raise TypeError(f"`even_batches` must be True, False or None. Received: even_batches={even_batches!r:.80}.")
        loaders = self.prepared.dataloaders
        dealers = [getattr(loader, "dealer", None) for loader in loaders]
        dealers = [d for d in dealers if d is not None and hasattr(d, "pads")]
        lists = [loader for loader in loaders if isinstance(loader, BatchesShard)]
        saved = [d.pads for d in dealers], [b.even_batches for b in lists]
        for dealer in dealers:
            # As each dealer computes it: a loader that drops its last round never pads.
            dealer.pads = even_batches and self.state.is_distributed and not getattr(dealer, "drop_last", False)
        for batches in lists:
            batches.even_batches = even_batches
        try:
            yield
        finally:
            for dealer, pads in zip(dealers, saved[0]):
                dealer.pads = pads
            for batches, even in zip(lists, saved[1]):
                batches.even_batches = even

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """Profiles the block with `torch.profiler` (Accelerate's method); yields the profiler.

        Args:
            profile_handler: A `ProfileKwargs`; default: the one in `kwargs_handlers`, else
                torch's defaults. With `output_trace_dir`, each process writes its Chrome trace
                there as `PROFILE_PROCESS_{rank}.json` when the block ends.
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        if not isinstance(handler, ProfileKwargs):
            raise TypeError(f"`profile_handler` must be a fittrain.utils.ProfileKwargs or None. Received: "
                            f"{handler!r:.80} ({type(handler).__name__}).")
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            profiler.export_chrome_trace(
                os.path.join(handler.output_trace_dir, f"PROFILE_PROCESS_{self.state.process_index}.json"))
        self.state.barrier()

    # ----------------------------------------------------------------- views of the configuration
    # Read from `dataloader_config` when a loader is prepared, so assigning a new
    # DataLoaderConfiguration to `accelerator.dataloader_config` takes effect for later loaders.
    @property
    def split_batches(self) -> bool:
        """`DataLoaderConfiguration.split_batches`."""
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        """`DataLoaderConfiguration.even_batches`."""
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        """`DataLoaderConfiguration.use_seedable_sampler`."""
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        """`DataLoaderConfiguration.non_blocking`."""
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        """Always True in effect: every prepared loader saves its position; this is the configured value."""
        return self.dataloader_config.use_stateful_dataloader

    @property
    def dispatch_batches(self) -> bool | None:
        """Always False or None: every process reads its own share."""
        return self.dataloader_config.dispatch_batches

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (`strategy="fsdp"`, or a layout's `dp_shard_size > 1`,
        on several processes): Accelerate's `distributed_type == FSDP`, not tensor parallelism alone."""
        return self.distributed_type.value == "FSDP"

    @property
    def torch_device_mesh(self) -> Any:
        """The `DeviceMesh` of the `parallelism_config`'s layout (built at the first `prepare` of a
        model, or here), or None without a layout or on one process."""
        return self.distributed_strategy.device_mesh() if self.parallelism_config is not None else None

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel rank: the ranks of one tensor-parallel group share it."""
        layout = self.parallelism_config
        return self.state.process_index if layout is None else layout.data_parallel_rank(self.state.process_index)

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank within its FSDP2 shard group (0 when nothing is sharded)."""
        layout = self.parallelism_config
        if layout is None:
            return self.state.process_index if self.distributed_strategy.is_sharding else 0
        return self.data_parallel_rank % layout.dp_shard_size

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank within its tensor-parallel group (0 without tensor parallelism)."""
        layout = self.parallelism_config
        return 0 if layout is None else self.state.process_index % layout.tp_size

    @property
    def multi_device(self) -> bool:
        """Whether more than one process takes part (Accelerate's name for it)."""
        return self.state.is_distributed

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files: the main one (others take part in gathering)."""
        return self.state.is_main_process

    @property
    def save_iteration(self) -> int:
        """The number the next automatically named checkpoint gets."""
        return self.project_configuration.iteration
