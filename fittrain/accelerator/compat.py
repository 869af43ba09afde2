"""Accelerate's methods that user scripts call and fittrain's own loop does not need.

A mixin of `Accelerator`: `prepare_model`/`prepare_optimizer`/`prepare_scheduler` (one kind
each), `trigger_sync_in_backward` (a loss built from several forwards under `no_sync`),
`join_uneven_inputs` (DDP's Join for loaders of different lengths), and read-only views of the
data loader configuration (`split_batches`, `use_seedable_sampler`, ...).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fittrain.accelerator.configuration import ProfileKwargs
from fittrain.data import BatchesShard, StreamShard
from fittrain.distributed.process_state import ProcessState


class CompatMethods:
    """Accelerate's less common Accelerator methods, on top of `prepare` and the process group."""

    state: ProcessState  # what the Accelerator provides
    strategy: str
    device_placement: bool
    _dataloaders: list[Any]

    def prepare(self, *objs: Any) -> Any:  # provided by the Accelerator
        raise NotImplementedError

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
            self.precision.wrap_forward(model)  # type: ignore[attr-defined]
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
        if not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            raise TypeError("prepare_scheduler() takes a torch LR scheduler. Received: "
                            f"{type(scheduler).__name__}.")
        return self.prepare(scheduler)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Makes the next backward of `model` synchronise gradients, also inside `no_sync`.

        For a loss built from several forwards, all but the last of which ran under `no_sync`
        (contrastive losses): DDP then reduces the gradients of this backward. Elsewhere (one
        process, FSDP2, which syncs per backward anyway) it does nothing.
        """
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        saved = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])  # what DDP's forward would have done with sync on
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = saved

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Lets processes with fewer batches finish while the others train (torch's `Join`).

        Args:
            joinables: DDP models (and other `torch.distributed.algorithms.Joinable` objects).
            even_batches: Overrides `even_batches` of the prepared loaders inside the block; pass
                False so that each process really sees only its own share.
        """
        if even_batches is not None and any(isinstance(loader, StreamShard) for loader in self._dataloaders):
            warnings.warn("Overriding even_batches is only supported for map-style datasets (a DataLoader over a "
                          "Dataset, or a list of batches); the prepared loaders over an IterableDataset keep "
                          "padding their last round, so every process takes the same number of steps.",
                          UserWarning, stacklevel=3)
        with self._even_batches_as(even_batches):
            if not self.state.is_distributed:
                yield
            elif self.strategy == "fsdp" or not all(isinstance(j, DistributedDataParallel) or
                                                   hasattr(j, "join_hook") for j in joinables):
                warnings.warn("join_uneven_inputs() works with DDP models (torch.distributed.algorithms.Join); "
                              "with FSDP2 or other objects the block runs without it, so uneven loaders may hang. "
                              "Use even_batches=True instead.", stacklevel=3)
                yield
            else:
                from torch.distributed.algorithms import Join

                with Join(list(joinables)):
                    yield

    @contextlib.contextmanager
    def _even_batches_as(self, even_batches: bool | None) -> Iterator[None]:
        if even_batches is None:
            yield
            return
        if not isinstance(even_batches, bool):
            raise TypeError(f"`even_batches` must be True, False or None. Received: even_batches={even_batches!r:.80}.")
        dealers = [getattr(loader, "dealer", None) for loader in self._dataloaders]
        dealers = [d for d in dealers if d is not None and hasattr(d, "pads")]
        lists = [loader for loader in self._dataloaders if isinstance(loader, BatchesShard)]
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
        handler = profile_handler or self.profile_handler or ProfileKwargs()  # type: ignore[attr-defined]
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
        return self.dataloader_config.split_batches  # type: ignore[attr-defined]

    @property
    def even_batches(self) -> bool:
        """`DataLoaderConfiguration.even_batches`."""
        return self.dataloader_config.even_batches  # type: ignore[attr-defined]

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value  # type: ignore[attr-defined]

    @property
    def use_seedable_sampler(self) -> bool:
        """`DataLoaderConfiguration.use_seedable_sampler`."""
        return self.dataloader_config.use_seedable_sampler  # type: ignore[attr-defined]

    @property
    def non_blocking(self) -> bool:
        """`DataLoaderConfiguration.non_blocking`."""
        return self.dataloader_config.non_blocking  # type: ignore[attr-defined]

    @property
    def use_stateful_dataloader(self) -> bool:
        """Always True in effect: every prepared loader saves its position; this is the configured value."""
        return self.dataloader_config.use_stateful_dataloader  # type: ignore[attr-defined]

    @property
    def dispatch_batches(self) -> bool | None:
        """Always False or None: every process reads its own share."""
        return self.dataloader_config.dispatch_batches  # type: ignore[attr-defined]

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP2 (`strategy="fsdp"` on several processes)."""
        return self.strategy == "fsdp" and self.state.is_distributed

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
        return self.project_configuration.iteration  # type: ignore[attr-defined]
