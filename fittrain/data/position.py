"""Where a prepared data source stands (`DataPosition`), and the per-batch bookkeeping every
prepared source shares (`PositionedSource`).

A position is kept per process, in batches of this run's dealing. Its state also holds the same
place as a count of the current epoch's order that all processes together consumed
(`order_consumed`: samples, or batches for sources that deal whole batches), which does not depend
on the number of processes: a resume on another number of processes (`load_state_dict` with a
state saved by N != M processes) deals the rest of the epoch's order to its M processes from that
count. The pass that does so starts at batch `start_batch` (`resume_start_batch`), so that a skip
count read off the position (`skip_first_batches(dl, dl.position.batches_consumed)`) stays right.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from fittrain.common.checks import is_int
from fittrain.data.devices import send_to_device
from fittrain.distributed.gradient_state import GradientState


@dataclasses.dataclass
class DataPosition:
    """Where a prepared loader stands in its passes (each source adds what it needs to rebuild a
    pass's order: see its `state_dict`).

    Attributes:
        seed: Kept for the checkpoint format (accelerator_state.json lists it); 0. Orders are drawn
            from the user's sampler and RNG now (`order`), not from a seed of ours.
        epoch: Completed passes.
        batches_consumed: Batches of the current epoch already handed out on this rank (counted
            from `start_batch`).
        start_items: Items of the current epoch's order that a run on another number of processes
            had consumed when this run resumed from its checkpoint; this epoch's pass deals the
            rest. 0 otherwise.
        start_batch: The batch number that pass starts at (`resume_start_batch`); 0 otherwise.
    """

    seed: int = 0
    epoch: int = 0
    batches_consumed: int = 0
    start_items: int = 0
    start_batch: int = 0

    def begin_epoch(self, epoch: int) -> None:
        """Moves to the start of `epoch` (a whole pass, dealt from its first item)."""
        self.epoch, self.batches_consumed, self.start_items, self.start_batch = epoch, 0, 0, 0


#: What `PositionedSource.state_dict()` holds besides a source's own parts (checkpoints check it).
STATE_KEYS = (*(field.name for field in dataclasses.fields(DataPosition)), "num_processes", "order_consumed")


def resume_start_batch(items: int, per_round: int) -> int:
    """The batch number at which a pass that deals an epoch's order from item `items` starts.

    `per_round` items are dealt per batch number (all processes together), so the consumed items
    fill this many of this run's rounds, rounded up: 0 only when nothing was consumed, so a
    resumed pass never looks like a fresh one, and equal to the rounds consumed when they fill
    whole rounds of this run.
    """
    return -(-items // per_round)


class PositionedSource:
    """What every prepared data source shares: a `DataPosition`, saved and restored by checkpoints,
    and the per-batch bookkeeping of an epoch (`_emit`)."""

    position: DataPosition
    gradient_state: GradientState
    num_processes: int = 1
    #: What the epoch's order counts (`order_consumed`), for messages: "samples" or "batches".
    _unit: str = "batches"
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
            position.begin_epoch(position.epoch + 1)
        finally:
            # The pass is over (or left early): like Accelerate, code after the loop is no longer "in
            # the last batch", and an enclosing pass's flags are the ones that count again.
            self.gradient_state.end_pass(flags)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle of `epoch`, for loops that number their epochs themselves."""
        if epoch != self.position.epoch:
            self.position.begin_epoch(epoch)

    def batches_left(self, skip: int) -> int:
        """Batches that a pass of the current epoch from batch `skip` yields on this rank."""
        return max(len(self) - skip, 0)

    def _order_consumed(self) -> int | None:
        """Items of the current epoch's order that all processes together consumed, or None when
        this source cannot tell (each process read its own share: it cannot be dealt again)."""
        return None

    def _items_per_round(self) -> int:
        """Items of the epoch's order that one batch number takes, all processes together."""
        return self.num_processes

    def _pass_start(self, skip: int) -> tuple[int, int]:
        """(items of the order consumed before this pass, its first batch number) for a pass of the
        current epoch from batch `skip`.

        After a resume on another number of processes the pass continues at `start_batch`; a
        pass from batch 0 runs the whole epoch again (as it does after any resume), and one from
        a batch before `start_batch` cannot be honoured.
        """
        position = self.position
        if not position.start_batch:
            return 0, 0
        if skip == 0:
            position.start_items = position.start_batch = 0
            return 0, 0
        if skip < position.start_batch:
            raise ValueError(
                f"This loader resumed from a checkpoint saved by another number of processes, after "
                f"{position.start_items} {self._unit} of epoch {position.epoch}'s order; in batches of this run "
                f"({self.num_processes} processes) that position is batch {position.start_batch} "
                f"(loader.position.batches_consumed). Received: skip={skip}, a count of batches of the run that "
                f"saved. Pass loader.position.batches_consumed to skip_first_batches, or 0 to run the whole "
                "epoch again.")
        return position.start_items, position.start_batch

    def state_dict(self) -> dict[str, Any]:
        """The data position (seed 0, epoch, batches consumed, where a re-dealt pass starts), the
        number of processes, and `order_consumed`: items of the current epoch's order consumed by
        all processes together (None when the source cannot be dealt again). JSON-safe."""
        return dict(dataclasses.asdict(self.position), num_processes=self.num_processes,
                    order_consumed=self._order_consumed())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position. By default it never skips by itself: pass `batches_consumed` to
        `skip_first_batches` to continue a half-finished epoch (with `resumes_itself`, the next
        pass does).

        A state saved by another number of processes continues the epoch from its
        `order_consumed`: this rank's position becomes batch `resume_start_batch(...)` of the
        epoch, whose rest is dealt to this run's processes (see the module docstring).

        Raises:
            ValueError: for a state that lacks one of `STATE_KEYS` or lies past the end of an epoch,
                or one of another number of processes whose `order_consumed` is None (a stream under way).
        """
        self._set_position(self._position_from(state))

    def _epoch_items(self) -> int | None:
        """Items (`_unit`) in an epoch's order, or None when unknown before the pass ends (a stream)."""
        return None

    def check_position(self, state: dict[str, Any]) -> None:
        """Raises ValueError when a saved state lacks one of `STATE_KEYS`, or its position lies past
        the end of this loader's epoch.

        A checkpoint is checked with it before anything is loaded (`checkpoint.checks`), so a
        damaged data-state file is refused instead of leaving a loader at batch 10**9. On the number
        of processes that saved it, at most the batches of this rank's epoch can have been consumed
        (a pass re-dealt from `start_items` has its own length); on another number, each batch takes
        one item of the order at least. A stream's length is unknown until it ends: it has no bound.

        Args:
            state: A `state_dict()` whose fields have the right types (ints; order_consumed may be None).
        """
        missing = [name for name in STATE_KEYS if name not in state]
        if missing:
            raise ValueError(f"The loader state has no {', '.join(missing)}. Received keys: {sorted(state)}. Load a "
                             "state_dict() that a prepared loader returned.")
        items = self._epoch_items()
        if items is None:
            return
        start_items = int(state["start_items"])
        if int(state["num_processes"]) == self.num_processes:
            most = int(state["start_batch"]) + -(-max(items - start_items, 0) // self._items_per_round())
        else:
            most = int(state["start_batch"]) + items
        bounds = {"order_consumed": items, "start_items": items, "start_batch": items, "batches_consumed": most}
        for name, limit in bounds.items():
            value = state.get(name)
            if isinstance(value, int) and value > limit:
                raise ValueError(
                    f"The loader state's {name}={value} lies past the end of an epoch of this loader ({len(self)} "
                    f"batches on this process, {items} {self._unit} in its order; at most {limit} here). Load a "
                    "state this loader saved, with the same dataset, batch size and number of processes.")

    def _position_from(self, state: dict[str, Any]) -> DataPosition:
        """The position `state` puts this rank at (see `load_state_dict`); changes nothing."""
        self.check_position(state)
        saved = int(state["num_processes"])
        seed, epoch = int(state["seed"]), int(state["epoch"])
        if saved == self.num_processes:
            return DataPosition(seed, epoch, int(state["batches_consumed"]), int(state["start_items"]),
                                int(state["start_batch"]))
        items = state["order_consumed"]
        if not is_int(items):
            raise ValueError(
                f"The loader state was saved by {saved} processes and this run has {self.num_processes}, but it "
                f"does not say how much of the epoch's order was consumed (order_consumed={items!r}), so the rest "
                f"cannot be dealt to {self.num_processes} processes. Resume with {saved} processes.")
        first = resume_start_batch(items, self._items_per_round())
        return DataPosition(seed, epoch, first, items, first)

    def _set_position(self, loaded: DataPosition) -> None:
        # In place: a SkippedDataLoader and the Trainer read this same object.
        for field in dataclasses.fields(DataPosition):
            setattr(self.position, field.name, getattr(loaded, field.name))
        self._resume_pending = self.resumes_itself and self.position.batches_consumed > 0
