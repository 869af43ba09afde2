"""ProgressBar: a tqdm bar for the epochs (one reset at each, or a line per epoch) and a transient one
per validation, on the main process only.

It is the Trainer's default display (`Trainer(enable_progress_bar=True)` adds one when no callback
draws progress itself), so it lives in the Trainer layer; users import it as
`fittrain.callbacks.ProgressBar`. Besides the bars it prints the module's parameter table when the
fit starts (`enable_model_summary`), one line when training starts (the run, where its
checkpoints and logs go) and one when the fit ends (where it stopped, the last metrics), so that a
fit without a Logger still says what it did. Other one-line messages of the
loop (the model summary, fast_dev_run, max_time) go the same way, through `say`.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tqdm.auto import tqdm

from fittrain.common.checks import check_bool
from fittrain.trainer.events import Callback, RunRequest
from fittrain.trainer.runs import describe_run
from fittrain.trainer.summary import summarize

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

#: Seconds between two readings of the prog_bar values while an epoch runs.
SHOW_EVERY_S = 0.5
#: Seconds between two advances of the epoch's bar (tqdm's own least interval between redraws).
ADVANCE_EVERY_S = 0.1


class ProgressBar(Callback):
    """Shows a tqdm bar per epoch (batches, it/s, and the values given to `show`) and a transient
    one during each validation. Only the main process draws; a bar redraws at most ten times a
    second, and per batch it only advances, so it costs no device sync.

    With `leave=False` (the default) one bar serves the fit: each epoch resets it, as Lightning's
    `TQDMProgressBar` does by default, and the last epoch's line stays. That keeps a fit of many
    short epochs to one line and costs one redraw per epoch; closing a bar and opening the next
    costs two and tqdm's bookkeeping (measured 0.3-0.9 ms an epoch, about 5 µs a step over a
    128-batch epoch). With `leave=True` each epoch's bar stays with its last values, a line per
    epoch as Keras prints them.

    A `Logger` owns one (its `progress_bar=` argument) and shows the loss, the learning rate and
    the validation metrics on it at its logging points. Alone, it shows progress only; a Trainer
    without either adds one (`enable_progress_bar`, which also switches every bar off when False).

    Args:
        enabled: False draws and prints nothing (every bar is a disabled tqdm).
        leave: Whether each epoch's finished bar stays (True), or one bar serves every epoch (False, the default).

    Raises:
        TypeError: when `enabled` or `leave` is not a bool.

    Example:
        >>> Trainer(callbacks=[ProgressBar()]).fit(module, loader)
    """

    def __init__(self, enabled: bool = True, leave: bool = False) -> None:
        self.enabled = check_bool("enabled", enabled, owner="ProgressBar")
        self.leave = check_bool("leave", leave, owner="ProgressBar")
        self._reset_next = False  # leave=False: the next epoch resets the open bar instead of drawing a new one
        self._show = False  # decided in on_fit_start: enabled, on the main process
        self._bar = tqdm(disable=True)
        self._val_bar = tqdm(disable=True)
        self._postfix: dict[str, str] = {}
        self._shown_at = 0.0  # time.monotonic() of the last show_logged
        self._uncounted = 0  # batches ended since the bar last advanced
        self._advance_at = 0.0  # time.monotonic() from which the next batch end advances the bar

    def run_request(self) -> RunRequest:
        """It draws the fit's progress: the Trainer adds no default bar."""
        return RunRequest(shows_progress=True)

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Decides whether this process draws (the main process only), forgets the last fit's values, and
        prints the module's parameter table (`Trainer(enable_model_summary=True)`), before prepare()."""
        self._show = self.enabled and trainer.enable_progress_bar and trainer.accelerator.is_main_process
        self._reset_next = False
        self._postfix = {}
        if self._show and trainer.enable_model_summary:
            tqdm.write(summarize(trainer.module))

    def on_train_start(self, trainer: "Trainer") -> None:
        """Says which run trains, and where its checkpoints and logs go."""
        if self._show:
            tqdm.write(describe_run(trainer))

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Starts this epoch's bar, from the batches a resumed epoch had consumed already (leave=False: the
        fit's one bar, reset; an epoch after the first starts at its first batch)."""
        self._uncounted = 0
        # A stream has no length: the bar then counts batches without a total (limit_train_batches gives one).
        total, desc = _total(trainer.num_training_batches), f"Epoch {trainer.state.epoch}"
        if self._reset_next:
            self._bar.set_description(desc, refresh=False)
            self._bar.reset(total=total)  # draws it once, named for this epoch
            return
        self._bar.close()
        done = getattr(getattr(trainer.train_loader, "position", None), "batches_consumed", 0)
        self._bar = tqdm(total=total, initial=done, desc=desc, mininterval=0.1, dynamic_ncols=True,
                         disable=not self._show)
        self._reset_next = self._show and not self.leave

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """Counts the batch. At most ten times a second it advances the epoch's bar by the batches
        counted, and at most every half second shows the values logged with prog_bar=True: per batch
        that is a clock reading, and tqdm's own update (a Python call) runs only when the bar redraws."""
        self._uncounted += 1
        now = time.monotonic()
        if now < self._advance_at:
            return
        self._advance_at = now + ADVANCE_EVERY_S
        self._advance()
        if trainer.logged.prog_bar and self._show and now - self._shown_at >= SHOW_EVERY_S:
            self._shown_at = now  # reading a device value syncs: not every step
            self.show_logged(trainer)

    def _advance(self) -> None:
        """Advances the epoch's bar by the batches ended since it last did."""
        if self._uncounted:
            self._bar.update(self._uncounted)
            self._uncounted = 0

    def show_logged(self, trainer: "Trainer") -> None:
        """Shows the current values of the metrics logged with `prog_bar=True`."""
        metrics = trainer.state.raw_metrics
        self.show({name: f"{float(metrics[name]):.4g}" for name in sorted(trainer.logged.prog_bar) if name in metrics},
                  refresh=False)

    def on_validation_start(self, trainer: "Trainer") -> None:
        """Starts the validation bar (the sanity check's, before training), which disappears when validation ends."""
        if not self._show:
            return
        self._advance()  # the epoch's bar shows where validation starts
        sanity = trainer.sanity_checking
        total = trainer.loops.num_sanity_val_batches if sanity else trainer.loops.num_val_batches
        self._val_bar = tqdm(total=_total(total), desc="Sanity Checking" if sanity else "Validation",
                             leave=False, mininterval=0.1, dynamic_ncols=True)

    def on_validation_batch_end(self, trainer: "Trainer") -> None:
        """Advances the validation bar."""
        self._val_bar.update()

    def on_validation_end(self, trainer: "Trainer") -> None:
        """Closes the validation bar; shows the values logged with prog_bar=True (not the sanity check's,
        which are discarded)."""
        self._val_bar.close()
        if trainer.logged.prog_bar and self._show and not trainer.sanity_checking:
            self.show_logged(trainer)

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """Shows the epoch's values logged with prog_bar=True and closes this epoch's bar."""
        self._advance()
        if trainer.logged.prog_bar and self._show:
            self.show_logged(trainer)
        if self.leave:
            self._bar.close()

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Closes the bars and says where training stopped, with the last metrics."""
        self.close()
        if self._show:
            state = trainer.state
            metrics = ", ".join(f"{name}={value:.4g}" for name, value in sorted(state.metrics.items()))
            tqdm.write(f"Fit done: {state.epoch} epoch(s), {state.global_step} optimizer step(s)"
                       + (f"; {metrics}." if metrics else "."))

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Closes the bars."""
        self.close()

    def show(self, values: Mapping[str, str], refresh: bool = True) -> None:
        """Shows `values` (formatted) after the epoch's bar, beside those shown before."""
        self._advance()
        self._postfix.update(values)
        self._bar.set_postfix(self._postfix, refresh=refresh)

    def close(self) -> None:
        """Closes both bars (what they showed stays on the terminal)."""
        self._reset_next = False
        self._advance()
        self._bar.close()
        self._val_bar.close()

    def __repr__(self) -> str:
        return f"ProgressBar(enabled={self.enabled}, leave={self.leave})"


def _total(batches: float | None) -> int | None:
    """A bar's total from a number of batches: None (no total) for a stream's inf."""
    return None if batches is None or math.isinf(batches) else int(batches)


def with_progress_bar(callbacks: list[Any], enabled: bool, muted: Sequence[Any] = ()) -> list[Any]:
    """`callbacks`, plus a `ProgressBar` when `enabled` and no callback draws progress itself
    (`RunRequest.shows_progress`), among those not `muted` (fast_dev_run mutes a Logger). Items
    that are not callbacks are left for the dispatcher to refuse."""
    draws = any(isinstance(cb, Callback) and not any(cb is m for m in muted) and cb.run_request().shows_progress
                for cb in callbacks)
    return callbacks if draws or not enabled else [*callbacks, ProgressBar()]


def say(trainer: "Trainer", text: str) -> None:
    """Writes `text` on the main process above any progress bar (tqdm.write): the loop's messages (the
    model summary, fast_dev_run's and max_time's lines). `enable_progress_bar=False` silences them too:
    it promises a fit that prints nothing."""
    if trainer.enable_progress_bar and trainer.accelerator.is_main_process:
        tqdm.write(text)
