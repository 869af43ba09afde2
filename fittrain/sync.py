"""Gradient-accumulation bookkeeping shared by one Accelerator's optimizer, scheduler and loaders.

Each Accelerator owns one `GradientState`; it is never shared between Accelerators.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GradientState:
    """Whether the current batch closes an accumulation window, and what the last step did.

    Attributes:
        num_steps: Batches accumulated per optimizer step.
        sync_gradients: True when gradients are synchronised and the optimizer really steps.
        end_of_dataloader: True on the last batch of the active prepared loader.
        step_was_skipped: True when the last real step was skipped by the fp16 scaler.
        batches_seen: Batches entered through `Accelerator.accumulate` so far.
        remainder: Real samples of the round the current batch belongs to when that round was
            padded to keep ranks in step (0: no padding); gather_for_metrics keeps that many.
        real_ranks: On the last batch of a padded last round whose sample count is unknown without
            loading (ready batches: `batch_size=None`), the ranks whose batch is real: ranks
            0..real_ranks-1 (0: not such a batch). gather_for_metrics keeps only their part.
    """

    num_steps: int = 1
    sync_gradients: bool = True
    end_of_dataloader: bool = False
    step_was_skipped: bool = False
    batches_seen: int = 0
    remainder: int = 0
    real_ranks: int = 0

    def begin_batch(self) -> None:
        """Counts one batch and decides whether it ends an accumulation window.

        A window also closes on the loader's last batch, so no gradient is left behind.
        """
        self.batches_seen += 1
        self.sync_gradients = self.batches_seen % self.num_steps == 0 or self.end_of_dataloader
        if self.end_of_dataloader:
            self.batches_seen = 0
