"""The native callbacks a Lightning Trainer always runs last: Lightning's logger connector (what its
loggers receive, and when), `min_epochs`/`min_steps`, and the collection of `predict`'s outputs.

Lightning's logging points, which `LoggerConnector` follows (`step` is Lightning's count of batches
that stepped the optimizer before the current one, fittrain's `global_step - 1` during fit):

    a training batch that stepped, when global_step % log_every_n_steps == 0 (or training stops):
        the step values (`x`, or `x_step`) and `epoch`, at step global_step - 1
    a validation's end (not the sanity check's): its loop means and what hooks logged, at global_step - 1
    a training epoch's end, after every on_train_epoch_end hook: the epoch values (`x`, `x_epoch`)
        and what hooks logged since the last row, at global_step - 1
    the end of `validate`/`test` outside fit: the loop's values, at step global_step

Each row goes to every logger's `log_metrics(row, step)`, followed by `save()`; a row with nothing
logged is not written. Rows are written on every process; the loggers write on the main one only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fittrain.lightning.sharding import real_batches
from fittrain.trainer.events import Callback as NativeCallback

if TYPE_CHECKING:
    from fittrain.lightning.trainer import Trainer


class LoggerConnector(NativeCallback):
    """Writes Lightning's rows to the Trainer's loggers (see the module docstring).

    Args:
        trainer: The Lightning Trainer: its loggers, `log_every_n_steps` and logged names.
    """

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self._last_step = 0
        self.eval_batches = 0  # Lightning's step of evaluation rows: batches evaluated in this stage

    def on_fit_start(self, trainer: Any) -> None:
        self.eval_batches = 0

    def on_sanity_check_end(self, trainer: Any) -> None:
        self.trainer.logged_names.reset()  # Lightning's views forget what the sanity check logged

    def on_validation_batch_end(self, trainer: Any) -> None:
        if not trainer.sanity_checking:
            self._eval_step_row(trainer)

    def on_test_batch_end(self, trainer: Any) -> None:
        self._eval_step_row(trainer)

    def _eval_step_row(self, trainer: Any) -> None:
        """A row of the evaluation batch's on_step values (no `epoch` column, as in Lightning)."""
        names = self.trainer.logged_names
        if names.eval_step_row:
            self._write(names.take_row(trainer.state.raw_metrics, "eval_step"), self.eval_batches, epoch=False)
        self.eval_batches += 1

    def on_train_epoch_start(self, trainer: Any) -> None:
        self._last_step = trainer.state.global_step

    def on_validation_start(self, trainer: Any) -> None:
        self.trainer.logged_names.start_loop()

    def on_test_start(self, trainer: Any) -> None:
        self.trainer.logged_names.start_loop()

    def on_train_batch_end(self, trainer: Any) -> None:
        step = trainer.state.global_step
        if step == self._last_step:  # inside an accumulation window, a skipped batch, or written already
            return
        self._step_row(trainer, step)

    def _step_row(self, trainer: Any, step: int) -> None:
        self._last_step = step
        lightning = self.trainer
        if lightning.log_every_n_steps and (step % lightning.log_every_n_steps == 0 or trainer.state.should_stop):
            self._write(lightning.logged_names.take_row(trainer.state.raw_metrics, "step"), step - 1)

    def on_validation_end(self, trainer: Any) -> None:
        if trainer.sanity_checking:
            return
        step = trainer.state.global_step
        if self.trainer.fitting and trainer.batch is not None and step != self._last_step:
            self._step_row(trainer, step)  # a validation after this batch's step: Lightning writes the step's row first
        step -= 1 if self.trainer.fitting else 0
        self._write(self.trainer.logged_names.take_row(trainer.state.raw_metrics, "eval"), step)

    def on_test_end(self, trainer: Any) -> None:
        self._write(self.trainer.logged_names.take_row(trainer.state.raw_metrics, "eval"), trainer.state.global_step)

    def on_train_epoch_end(self, trainer: Any) -> None:
        self._write(self.trainer.logged_names.take_row(trainer.state.raw_metrics, "epoch"),
                    trainer.state.global_step - 1)

    def _write(self, row: dict[str, float], step: int, epoch: bool = True) -> None:
        loggers = self.trainer.loggers
        if not row or not loggers:
            return
        if epoch:
            row.setdefault("epoch", self.trainer.current_epoch)
        for logger in loggers:
            logger.log_metrics(dict(row), step=max(step, 0))
            logger.save()


class OptimizerSteps(NativeCallback):
    """`global_step` as Lightning counts it in manual optimization: each optimizer's `step()` (a GAN's
    two optimizers take two steps per batch), where the native count is batches that stepped; saved in
    checkpoints. `ManualSteps` counts them, in the fits of modules with manual optimization.

    Attributes:
        count: The optimizer steps of this fit.
    """

    def __init__(self) -> None:
        self.count = 0

    def on_fit_start(self, trainer: Any) -> None:
        if not trainer.state.global_step:  # a fit going on from the last one keeps its count
            self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("count", 0))


class ManualSteps(NativeCallback):
    """Manual optimization as Lightning runs it, where it differs from the native loop, step by step:

    - each optimizer step is counted into `OptimizerSteps`;
    - under DDP, the module's buffers (BatchNorm statistics) are broadcast from process 0 before
      each training_step, as DDP's forward does in Lightning, which runs training_step through it
      (the native loop runs it on the module itself, fittrain/trainer/manual.py).

    Only a fit of a module with manual optimization has it, last among the callbacks (it keeps no
    state), so that automatic optimization fires no per-step event for it.

    Args:
        steps: Where the count goes.
    """

    def __init__(self, steps: OptimizerSteps) -> None:
        self.steps = steps
        self._buffers: list[Any] = []

    def on_train_start(self, trainer: Any) -> None:
        """Decides once whether buffers are broadcast: under DDP, with buffers."""
        acc = trainer.accelerator
        ddp = acc.num_processes > 1 and type(acc.distributed_strategy).__name__ == "DDPStrategy"
        self._buffers = list(trainer.module.buffers()) if ddp else []

    def on_train_batch_start(self, trainer: Any) -> None:
        if self._buffers:
            import torch.distributed as dist  # imported by every DDP run already

            for buffer in self._buffers:
                dist.broadcast(buffer, src=0)

    def on_before_optimizer_step(self, trainer: Any) -> None:
        self.steps.count += 1


class MinimumLimits(NativeCallback):
    """`min_epochs` and `min_steps`: a stop asked before both are reached (EarlyStopping, a module's
    `trainer.should_stop = True`) waits until the end of the first epoch that reaches them, as in Lightning.

    Args:
        min_epochs: Epochs to train at least.
        min_steps: Optimizer steps to train at least.
    """

    def __init__(self, min_epochs: int, min_steps: int) -> None:
        self.min_epochs, self.min_steps = min_epochs, min_steps
        self._deferred = False

    def on_fit_start(self, trainer: Any) -> None:
        self._deferred = False

    def _reached(self, trainer: Any, epochs_done: int) -> bool:
        return epochs_done >= self.min_epochs and trainer.state.global_step >= self.min_steps

    def on_validation_end(self, trainer: Any) -> None:
        self._defer(trainer, trainer.state.epoch)  # the epoch is not done yet

    def on_train_epoch_end(self, trainer: Any) -> None:
        if not self._defer(trainer, trainer.state.epoch + 1) and self._deferred:
            trainer.state.should_stop = True

    def _defer(self, trainer: Any, epochs_done: int) -> bool:
        """Holds back a stop asked too early; returns whether the limits are still ahead."""
        ahead = not self._reached(trainer, epochs_done)
        if ahead and trainer.state.should_stop:
            self._deferred, trainer.state.should_stop = True, False
        return ahead


class Predictions(NativeCallback):
    """Keeps each batch's `predict_step` output, as this process computed it (Lightning's `predict`
    returns these, one list item per batch, instead of the native gathered concatenation).

    Attributes:
        outputs: The outputs of the current `predict`, or None when not collecting.
    """

    def __init__(self) -> None:
        self.outputs: list[Any] | None = None
        self.real: int | None = None  # this process's own batches; the rest only pad the last round

    def on_predict_start(self, trainer: Any) -> None:
        self.real = real_batches(getattr(trainer.data, "last_loader", None), trainer.accelerator.process_index)

    def on_predict_batch_end(self, trainer: Any) -> None:
        if self.outputs is not None and (self.real is None or len(self.outputs) < self.real):
            self.outputs.append(trainer.evaluation.outputs)
