"""Automatic optimization, and the choice between it and manual optimization.

`prepare_optimization` reads `configure_optimizers` (fittrain/trainer/configure.py), prepares the
module with its optimizers, and returns the object behind the Trainer's `train_batch(batch)`:

- `AutomaticOptimization` (the default): the Trainer runs backward on the loss `training_step`
  returns and steps the one optimizer and its scheduler (`Schedule`) at the end of each
  accumulation window;
- `ManualOptimization` (fittrain/trainer/manual.py, `automatic_optimization = False`):
  `training_step` steps any number of optimizers itself.

Both have the same surface: `model`, `optimizers`, `schedulers`, `schedule`, `is_manual`, and
`train_batch(batch) -> bool` (whether the batch ended with an optimizer step), so the loop never
asks which one runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fittrain.trainer.configure import check_automatic_optimization, parse_manual_optimizers, parse_optimizers
from fittrain.trainer.events import Event
from fittrain.trainer.manual import ManualOptimization
from fittrain.trainer.parts import StepRunner, explain_backward_error, extract_loss, warn_once
from fittrain.trainer.schedules import Schedule, make_schedule

if TYPE_CHECKING:
    from fittrain.trainer.module import TrainModule
    from fittrain.trainer.trainer import Trainer


class AutomaticOptimization:
    """One batch of automatic optimization: forward, backward and, at the end of an accumulation
    window, the optimizer step and the scheduler's (nanoGPT's step order).

    Args:
        trainer: The Trainer fitting `module` (its state, events and accelerator).
        model: The prepared model.
        module: The TrainModule.
        optimizer: The prepared optimizer.
        schedule: Steps the scheduler at the loop's fixed points (fittrain/trainer/schedules.py).
    """

    is_manual = False

    def __init__(self, trainer: "Trainer", model: nn.Module, module: "TrainModule", optimizer: Any,
                 schedule: Schedule) -> None:
        self.trainer, self.model, self.optimizer, self.schedule = trainer, model, optimizer, schedule
        self.optimizers = [optimizer]
        self.schedulers = [schedule.scheduler] if schedule.scheduler else []
        # The batch's training_step output and the loss backward runs on, for the module's hooks
        # (on_train_batch_end(outputs, ...), on_before_backward(loss)).
        self.outputs: Any = None
        self.loss: Any = None
        self._run = StepRunner(model, module, trainer.accelerator.distributed_strategy)
        acc, events = trainer.accelerator, trainer.events
        # Decided once per fit: without accumulation or mixed precision, `_plain_batch` trains each batch.
        if acc.gradient_accumulation_steps == 1 and acc.precision.plain:
            self.train_batch = self._plain_batch  # type: ignore[method-assign]
        self._gradient_state = acc.gradient_state
        self._training_step = self._run.bound("training_step")
        self._listened = tuple(events.listens(event) for event in (
            Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD, Event.BEFORE_OPTIMIZER_STEP))

    def train_batch(self, batch: Any) -> bool:
        """Trains on one batch; True when it ended an accumulation window with an optimizer step."""
        trainer = self.trainer
        acc, fire, state = trainer.accelerator, trainer.events.fire, trainer.state
        with acc.accumulate(self.model):
            with acc.autocast():
                self.outputs = outputs = self._run("training_step", batch, state.batch_idx)
            self.loss = loss = extract_loss(outputs)
            if loss is None:
                return self._skip()
            trainer.logged.record_loss(loss)
            fire(Event.BEFORE_BACKWARD, trainer)
            try:
                acc.backward(loss)
            except RuntimeError as err:  # costs nothing until it raises
                explain_backward_error(loss, err)
                raise
            fire(Event.AFTER_BACKWARD, trainer)
            if not acc.sync_gradients:  # inside an accumulation window: gradients add up
                return False
            fire(Event.BEFORE_OPTIMIZER_STEP, trainer)
            self.optimizer.step()
            self.optimizer.zero_grad()
            state.global_step += 1
            self.schedule.after_optimizer_step(state.global_step)
        return True

    def _plain_batch(self, batch: Any) -> bool:
        """`train_batch` with every batch a window of one, in full precision: what `train_batch` does,
        with no context entered, backward and the step called on torch directly, and an event fired
        only where a hook listens. This is the hand loop's per-step work, which the overhead
        benchmark holds the Trainer to."""
        trainer = self.trainer
        state = trainer.state
        self._gradient_state.begin_batch()  # counts the batch, as accumulate() does (accelerator.step)
        step, takes_index = self._training_step
        self.outputs = outputs = step(batch, state.batch_idx) if takes_index else step(batch)
        # extract_loss's common case first, inline: this runs every step.
        self.loss = loss = outputs if type(outputs) is torch.Tensor and not outputs.ndim else extract_loss(outputs)
        if loss is None:
            return self._skip()
        trainer.logged.record_loss(loss)
        before_backward, after_backward, before_step = self._listened
        if before_backward:
            trainer.events.fire(Event.BEFORE_BACKWARD, trainer)
        try:
            loss.backward()  # Accelerator.backward divides by a window of 1 and scales by nothing
        except RuntimeError as err:
            explain_backward_error(loss, err)
            raise
        if after_backward:
            trainer.events.fire(Event.AFTER_BACKWARD, trainer)
        if before_step:
            trainer.events.fire(Event.BEFORE_OPTIMIZER_STEP, trainer)
        # The prepared optimizer's step and zero_grad are these calls when every batch steps in full
        # precision. `.step` is looked up each time: an LR scheduler patches it to count steps.
        inner = self.optimizer.optimizer
        inner.step()
        inner.zero_grad()
        state.global_step += 1
        if self.schedule.every_step:
            self.schedule.after_optimizer_step(state.global_step)
        return True

    def _skip(self) -> bool:
        """A batch whose training_step returned None: no backward, no step (a warning, once)."""
        warn_once(self.trainer, "training_step returned None: the batch is skipped (no backward, no step).")
        return False


def prepare_optimization(trainer: "Trainer", module: "TrainModule",
                         validates: bool) -> AutomaticOptimization | ManualOptimization:
    """Reads the module's `configure_optimizers`, prepares the module with the optimizers (and the
    automatic mode's scheduler), and returns the optimization that trains its batches.

    Args:
        trainer: The Trainer starting a fit.
        module: The TrainModule.
        validates: Whether fit received a val_loader (a plateau scheduler needs one).

    Raises:
        TypeError, ValueError: for what `configure_optimizers` returned (fittrain/trainer/configure.py).
    """
    acc = trainer.accelerator
    if not check_automatic_optimization(module):  # training_step steps them itself: fittrain/trainer/manual.py
        optimizers, schedulers = parse_manual_optimizers(module)
        model, *prepared = acc.prepare(module, *optimizers)
        return ManualOptimization(trainer, model, module, prepared, schedulers)
    optimizer, config = parse_optimizers(module)
    model, optimizer = acc.prepare(module, optimizer)
    schedule = make_schedule(config, acc, validates, trainer.val_every_n_epochs, trainer.val_every_n_steps)
    return AutomaticOptimization(trainer, model, module, optimizer, schedule)
