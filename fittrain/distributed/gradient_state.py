"""Gradient-accumulation bookkeeping shared by one Accelerator's optimizer, scheduler and loaders.

Each Accelerator owns one `GradientState`; it is never shared between Accelerators.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class LoaderFlags:
    """What the batch one pass of a prepared loader handed out last says about the data's end.

    Attributes:
        end_of_dataloader: True on the pass's last batch.
        remainder: Real samples of the round the current batch belongs to when that round was
            padded to keep ranks in step (0: no padding); gather_for_metrics keeps that many.
        real_ranks: On the last batch of a padded last round whose sample count is unknown without
            loading (ready batches: `batch_size=None`), the ranks whose batch is real: ranks
            0..real_ranks-1 (0: not such a batch). gather_for_metrics keeps only their part.
    """

    end_of_dataloader: bool = False
    remainder: int = 0
    real_ranks: int = 0
    loader: Any = None  # the prepared loader running the pass


@dataclass
class GradientState:
    """Whether the current batch closes an accumulation window, and what the last step did.

    The end-of-data flags belong to the innermost pass of a prepared loader still running: an
    evaluation loop run to its end inside a training loop leaves the training loop's flags as
    they were (a stack, as in Accelerate), so `gather_for_metrics` on the outer loop's last batch
    still drops its padding.

    Attributes:
        num_steps: Batches accumulated per optimizer step.
        sync_gradients: True when gradients are synchronised and the optimizer really steps.
        step_was_skipped: True when the last real step was skipped by the fp16 scaler.
        batches_seen: Batches entered through `Accelerator.accumulate` so far.
    """

    num_steps: int = 1
    sync_gradients: bool = True
    step_was_skipped: bool = False
    batches_seen: int = 0
    sync_with_dataloader: bool = True  # a loader's last batch closes the window (GradientAccumulationPlugin)
    adjust_scheduler: bool = True
    _passes: list[LoaderFlags] = dataclasses.field(default_factory=list, repr=False)
    # What the flags read outside any pass; never written, so no object is made per step.
    _idle: LoaderFlags = dataclasses.field(default_factory=LoaderFlags, repr=False, compare=False)

    @property
    def _flags(self) -> LoaderFlags:
        return self._passes[-1] if self._passes else self._idle

    @property
    def end_of_dataloader(self) -> bool:
        """True on the last batch of the innermost running pass of a prepared loader."""
        return self._flags.end_of_dataloader

    @property
    def remainder(self) -> int:
        """The innermost pass's `LoaderFlags.remainder`."""
        return self._flags.remainder

    @property
    def real_ranks(self) -> int:
        """The innermost pass's `LoaderFlags.real_ranks`."""
        return self._flags.real_ranks

    @property
    def in_dataloader(self) -> bool:
        """Whether a pass of a prepared loader is running."""
        return bool(self._passes)

    @property
    def active_dataloader(self) -> Any:
        """The prepared loader of the innermost running pass, or None (Accelerate's name)."""
        return self._passes[-1].loader if self._passes else None

    def begin_pass(self, loader: Any = None) -> LoaderFlags:
        """Starts a pass of the prepared `loader`; it sets the returned flags as its batches go by."""
        flags = LoaderFlags(loader=loader)
        self._passes.append(flags)
        return flags

    def end_pass(self, flags: LoaderFlags) -> None:
        """Ends the pass that `begin_pass` returned `flags` to (also one left early, in any order)."""
        self._passes[:] = [f for f in self._passes if f is not flags]

    def begin_batch(self) -> None:
        """Counts one batch and decides whether it ends an accumulation window.

        A window also closes on the loader's last batch, so no gradient is left behind (unless
        `sync_with_dataloader` is False: the window then carries over into the next pass).
        """
        self.batches_seen += 1
        passes = self._passes  # `end_of_dataloader`, read without two property calls: this runs every batch
        ends_data = (passes[-1] if passes else self._idle).end_of_dataloader and self.sync_with_dataloader
        self.sync_gradients = self.batches_seen % self.num_steps == 0 or ends_data
        if ends_data:
            self.batches_seen = 0
