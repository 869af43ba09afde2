"""Lightning's metric views over fittrain's metrics: `callback_metrics`, `logged_metrics`,
`progress_bar_metrics`, and the rows Lightning's loggers receive.

The native Trainer keeps every metric in `trainer.state.raw_metrics`: what `self.log` recorded (with
`x_step`/`x_epoch` when both were asked, and `x` the latest of the two), and also what fittrain adds
on its own (`train_loss`, `grad_norm`, a value `validation_step` returned). Lightning's views hold
only what `self.log` recorded, and only in the current run: each `fit`, `validate`, `test` and
`predict` starts them empty, and what the sanity check logged is dropped when it ends. So `LoggedNames` notes,
at each `self.log` call (LightningModule.log), which names that call produced and where:

    in a training batch   x (on_step) or x (on_epoch), or x_step and x_epoch when both
    in an evaluation loop x, the loop's mean
    elsewhere (a hook)    x, the value itself

and the views read those names' current values from the native metrics:

    callback_metrics      every name above and `x` for a forked one (tensors)
    logged_metrics        the names with logger=True: x, or x_step and x_epoch (tensors)
    progress_bar_metrics  the names with prog_bar=True, as logged_metrics names them (floats)

A call is noted once per (name, place, options) and row: the per-step cost is one set lookup, which
LightningModule.log makes itself in a training batch, where it runs at every step (`seen`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class LoggedNames:
    """The names `self.log` produced in the current run, by view, and the rows waiting for the loggers.

    Attributes:
        callback, logged, pbar: The names of each view, in first-logged order.
        step_row: The step names (logger=True) written at each training logging point of this epoch.
        epoch_row: The epoch names (logger=True) written when the training epoch ends.
        eval_row: The names (logger=True) an evaluation loop logged, written when the loop ends.
        pending: Names (logger=True) logged in a hook, written with the next epoch-level row.
        extra: Values callbacks put into `callback_metrics` themselves (LearningRateMonitor).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Empties every view: a run starts, or the sanity check ended (Lightning's views hold what it
        logged while it runs, and nothing of it afterwards)."""
        self.callback: dict[str, None] = {}
        self.logged: dict[str, None] = {}
        self.pbar: dict[str, None] = {}
        self.step_row: dict[str, None] = {}
        self.epoch_row: dict[str, None] = {}
        self.eval_row: dict[str, None] = {}
        self.pending: dict[str, None] = {}
        self.results: dict[str, None] = {}  # what validate/test return: the loop-level names (logger=True)
        self.extra: dict[str, torch.Tensor] = {}
        # Names the native metrics hold under another name (an evaluation's `x_epoch` is its `x`), and
        # values they do not hold at all (an evaluation's per-batch `x_step`, with the names to write).
        self.aliases: dict[str, str] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.eval_step_row: dict[str, None] = {}
        # An evaluation loop's rank-local means of what was logged without sync_dist (Lightning's: each
        # process its own; the native loop averages over every process): name -> [sum, weight].
        self.local: dict[str, list[Any]] = {}
        # The calls noted since the last row, as (name, place, prog_bar, logger, on_step, on_epoch).
        self.seen: set[tuple[Any, ...]] = set()

    def start_loop(self) -> None:
        """An evaluation loop starts: its local means start over."""
        self.local = {}

    def add_local(self, name: str, value: Any, weight: float) -> None:
        """Adds an evaluation batch's value of `name` (logged without sync_dist) to its local mean, in
        float32 as Lightning accumulates it."""
        value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        entry = self.local.get(name)
        if entry is None:
            self.local[name] = [value * weight, weight]
        else:
            entry[0] = entry[0] + value * weight
            entry[1] += weight

    def note(self, trainer: "Trainer", name: str, prog_bar: bool, logger: bool, on_step: bool | None,
             on_epoch: bool | None) -> None:
        """Notes what `self.log(name, ..., prog_bar, logger, on_step, on_epoch)` records, where it is called."""
        evaluation = trainer.evaluation
        if evaluation.averager is not None:
            place = "eval"
        elif trainer.batch is None or evaluation.running:
            place = "hook"
        else:
            place = "step"
        key = (name, place, prog_bar, logger, on_step, on_epoch)
        if key in self.seen:
            return
        self.seen.add(key)
        if place == "step":
            self._note_step(name, prog_bar, logger, on_step is None or bool(on_step), bool(on_epoch))
            return
        if place == "eval" and on_step:
            self._note_eval_step(name, prog_bar, logger, on_epoch is not False)
            return
        self._add(self.callback, name)
        self._flags(name, prog_bar, logger)
        if logger:
            self._add(self.eval_row if place == "eval" else self.pending, name)
            self._add(self.results, name)

    def _note_eval_step(self, name: str, prog_bar: bool, logger: bool, epoch: bool) -> None:
        """on_step=True in an evaluation loop: `x_step` per batch for the loggers and, unless
        on_epoch=False, `x`/`x_epoch` the loop's mean (the native metric `x`)."""
        step_name = f"{name}_step" if epoch else name
        self._flags(step_name, prog_bar, logger)
        if logger:
            self._add(self.eval_step_row, step_name)
        if epoch:
            epoch_name = f"{name}_epoch"
            self.aliases[epoch_name] = name
            self._add(self.callback, name)
            self._add(self.callback, epoch_name)
            self._flags(epoch_name, prog_bar, logger)
            if logger:
                self._add(self.eval_row, epoch_name)
                self._add(self.results, epoch_name)

    def record_eval_step(self, name: str, value: Any, on_epoch: bool | None) -> None:
        """Keeps an evaluation batch's on_step value (the native metrics keep only the loop's mean)."""
        step_name = f"{name}_step" if on_epoch is not False else name
        self.values[step_name] = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))

    def _note_step(self, name: str, prog_bar: bool, logger: bool, step: bool, epoch: bool) -> None:
        step_name, epoch_name = (f"{name}_step", f"{name}_epoch") if step and epoch else (name, name)
        self._add(self.callback, name)
        if step:
            self._add(self.callback, step_name)
            self._flags(step_name, prog_bar, logger)
            if logger:
                self._add(self.step_row, step_name)
        if epoch:
            self._add(self.callback, epoch_name)
            self._flags(epoch_name, prog_bar, logger)
            if logger:
                self._add(self.epoch_row, epoch_name)

    def _flags(self, name: str, prog_bar: bool, logger: bool) -> None:
        if logger:
            self._add(self.logged, name)
        if prog_bar:
            self._add(self.pbar, name)

    @staticmethod
    def _add(names: dict[str, None], name: str) -> None:
        names[name] = None

    # ----------------------------------------------------------------- the views
    def value(self, raw: dict[str, Any], name: str) -> Any:
        """The current value of a view's `name`, or None when nothing was recorded under it yet."""
        if name in self.values:
            return self.values[name]
        name = self.aliases.get(name, name)
        local = self.local.get(name)
        if local is not None:
            return local[0] / local[1]
        return raw.get(name)

    def _view(self, raw: dict[str, Any], names: dict[str, None]) -> dict[str, Any]:
        found = {name: self.value(raw, name) for name in names}
        return {name: value for name, value in found.items() if value is not None}

    def callback_metrics(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Lightning's `trainer.callback_metrics`: every logged name's current value, as a tensor."""
        values = {name: _tensor(value) for name, value in self._view(raw, self.callback).items()}
        values.update(self.extra)
        return values

    def logged_metrics(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Lightning's `trainer.logged_metrics`: the names logged with logger=True."""
        return {name: _tensor(value) for name, value in self._view(raw, self.logged).items()}

    def progress_bar_metrics(self, raw: dict[str, Any]) -> dict[str, float]:
        """Lightning's `trainer.progress_bar_metrics`: the names logged with prog_bar=True, as floats."""
        return {name: float(value) for name, value in self._view(raw, self.pbar).items()}

    def loop_results(self, raw: dict[str, Any]) -> dict[str, float]:
        """What Lightning's validate/test return: the loop-level names logged with logger=True, as floats."""
        return {name: float(value) for name, value in self._view(raw, self.results).items()}

    # ----------------------------------------------------------------- the loggers' rows
    def take_row(self, raw: dict[str, Any], kind: str) -> dict[str, float]:
        """The values of a row for the loggers, as floats: "step" (a training logging point), "eval"
        (an evaluation loop ended, with the names hooks logged since the last row) or "epoch" (the
        training epoch ended, likewise). An epoch-level row's names are then forgotten; the step names
        are forgotten when the epoch ends, as Lightning resets its results there."""
        if kind == "step":
            return self._float32_row(raw, self.step_row)
        if kind == "eval_step":
            return self._float32_row(raw, self.eval_step_row)
        names = {**(self.eval_row if kind == "eval" else self.epoch_row), **self.pending}
        row = self._float32_row(raw, names)
        self.pending = {}
        if kind == "eval":
            self.eval_row = {}
        else:
            self.epoch_row, self.step_row = {}, {}
        self.seen.clear()  # a name logged again must be noted again for the next row
        return row


    def _float32_row(self, raw: dict[str, Any], names: dict[str, None]) -> dict[str, float]:
        """The values of `names` as Lightning's loggers get them: float32 values (fittrain reduces epoch
        means in float64), read with one conversion for the row."""
        found = self._view(raw, names)
        if not found:
            return {}
        values = torch.tensor([float(value) for value in found.values()], dtype=torch.float32).tolist()
        return dict(zip(found, values))


def _tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value))
