"""The sanity check: `Trainer(num_sanity_val_steps=n)` validates n batches before training starts.

Lightning's, in its order and with its hooks: after `on_fit_start`, `prepare()` and the module's
setup, before `on_train_start`, the Trainer fires `on_sanity_check_start`, runs a validation over
the first n batches of the val loader (with every validation event; `trainer.sanity_checking` is
True throughout), and fires `on_sanity_check_end`. Then, as Lightning does:

- what it logged or returned is discarded: `trainer.state.metrics` is what it was before;
- every random generator (Python, NumPy, torch, CUDA) is put back where it was, so the val
  loader's draws (its iterator takes a seed from torch's global generator) do not change the
  shuffle of the first training epoch: a fit draws the same numbers with or without a sanity check;
- a resumed fit does not run it, so a resumed run stays bitwise the uninterrupted one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from fittrain.checkpoint.rng import capture_rng_state, restore_rng_state
from fittrain.trainer.events import Event

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


def run_sanity_check(trainer: "Trainer", validate: Callable[[], Any]) -> None:
    """Runs the sanity check when it is due: `trainer.num_sanity_val_batches` > 0 (which is 0 without
    a val_loader, with limit_val_batches=0, with fast_dev_run and in a resumed fit).

    Args:
        trainer: The fitting Trainer, prepared.
        validate: Runs the Trainer's validation over the sanity check's batches.
    """
    if not trainer.loops.num_sanity_val_batches:
        return
    state = trainer.state
    metrics, random_state = dict(state.raw_metrics), capture_rng_state()
    trainer.sanity_checking = True
    try:
        trainer.events.fire(Event.SANITY_CHECK_START, trainer)
        validate()
        trainer.events.fire(Event.SANITY_CHECK_END, trainer)
    finally:
        trainer.sanity_checking = False
        state.raw_metrics.clear()  # in place: callbacks may hold the mapping itself
        state.raw_metrics.update(metrics)
        restore_rng_state(random_state)
