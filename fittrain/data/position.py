"""Where a prepared data source stands (`DataPosition`), and the per-batch bookkeeping every
prepared source shares (`PositionedSource`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from ..sync import GradientState
from .devices import send_to_device


@dataclasses.dataclass
class DataPosition:
    """Where a prepared loader stands in its passes (each source adds what it needs to rebuild a
    pass's order: see its `state_dict`).

    Attributes:
        seed: Kept for the checkpoint format (accelerator_state.json lists it); 0. Orders are drawn
            from the user's sampler and RNG now (`order`), not from a seed of ours.
        epoch: Completed passes.
        batches_consumed: Batches of the current epoch already handed out on this rank.
    """

    seed: int = 0
    epoch: int = 0
    batches_consumed: int = 0


class PositionedSource:
    """What every prepared data source shares: a `DataPosition`, saved and restored by checkpoints,
    and the per-batch bookkeeping of an epoch (`_emit`)."""

    position: DataPosition
    gradient_state: GradientState
    device: torch.device | None
    _moves_batches: bool = False
    _non_blocking: bool = False
    #: `DataLoaderConfiguration(use_stateful_dataloader=True)`: after `load_state_dict`, the next
    #: pass continues the saved epoch by itself (as torchdata's StatefulDataLoader does).
    resumes_itself: bool = False
    _resume_pending: bool = False

    def sync_rng(self) -> None:
        """Called when a pass starts: Accelerator(rng_types=["torch", ...]) sets it to copy process
        0's global generators to every process; by default it does nothing."""

    def __iter__(self) -> Iterator[Any]:
        skip = self.position.batches_consumed if self._resume_pending else 0
        self._resume_pending = False
        return self.iterate(skip=skip)

    def iterate(self, skip: int) -> Iterator[Any]:  # each kind of source defines it
        raise NotImplementedError

    def _emit(self, batches: Iterator[Any], skip: int, total: int, remainder: int = 0,
              real_ranks: int = 0) -> Iterator[Any]:
        """Yields this epoch's batches `skip`..`total - 1` from `batches`, on the device, keeping the
        position and the accumulation state (`end_of_dataloader`, `remainder`, `real_ranks`) up
        to date. Only the last round is padded: `remainder` (real samples) or `real_ranks` (ranks
        holding a real batch) describe it, for gather_for_metrics."""
        position, last = self.position, total - 1
        flags = self.gradient_state.begin_pass(self)
        try:
            for index, batch in zip(range(skip, total), batches):  # range first: no batch is pulled past the end
                position.batches_consumed = index + 1
                if index == last:
                    flags.end_of_dataloader, flags.remainder, flags.real_ranks = True, remainder, real_ranks
                yield send_to_device(batch, self.device, self._non_blocking) if self._moves_batches else batch
            position.epoch += 1
            position.batches_consumed = 0
        finally:
            # The pass is over (or left early): like Accelerate, code after the loop is no longer "in
            # the last batch", and an enclosing pass's flags are the ones that count again.
            self.gradient_state.end_pass(flags)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of `epoch`, for loops that number their epochs themselves."""
        if epoch != self.position.epoch:
            self.position.epoch, self.position.batches_consumed = epoch, 0

    def state_dict(self) -> dict[str, int]:
        """The data position: seed (0), epoch and batches consumed (JSON-safe)."""
        return dataclasses.asdict(self.position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores the position. By default it never skips by itself: pass `batches_consumed` to
        `skip_first_batches` to continue a half-finished epoch (with `resumes_itself`, the next
        pass does)."""
        self.position.seed = int(state["seed"])
        self.position.epoch = int(state["epoch"])
        self.position.batches_consumed = int(state["batches_consumed"])
        self._resume_pending = self.resumes_itself and self.position.batches_consumed > 0
