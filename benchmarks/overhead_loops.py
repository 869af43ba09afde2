"""The loops the overhead benchmark times: a hand-written loop, fittrain's, and other libraries'.

Each returns a `RunResult`. What a user builds once (model, optimizer, Accelerator, prepare()) is
built before the call is timed; `Trainer.fit` is timed whole, since that is the call users make.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import torch
from torch.nn import functional as F

import fittrain.lightning as fittrain_lightning
from benchmarks.workload import (
    CHECKPOINT_EVERY,
    LOGGER_EVERY,
    NUM_BATCHES,
    Batch,
    RunResult,
    TimedList,
    TinyMLP,
    Workload,
    cycle,
    result,
)
from fittrain import Accelerator, Trainer


def run_hand(work: Workload, mode: str) -> RunResult:
    """The baseline: zero_grad, forward, loss, backward, step."""
    clock = work.clock()
    model = work.model()
    optimizer = model.configure_optimizers()
    source = work.source(mode, clock)
    start = work.now()
    for x, y in cycle(source, work.steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return result(clock, start, work)


def run_accelerator(work: Workload, mode: str) -> RunResult:
    """fittrain's Accelerator loop, as an Accelerate user writes it (no accumulate())."""
    clock = work.clock()
    accelerator = Accelerator(cpu=True)
    model = work.model()
    optimizer = model.configure_optimizers()
    if mode != "prebuilt":
        model, optimizer, source = accelerator.prepare(model, optimizer, work.source(mode, clock))
    else:  # pre-built batches are already where they belong: nothing to prepare
        model, optimizer = accelerator.prepare(model, optimizer)
        source = TimedList(work.batches, clock)
    start = work.now()
    for x, y in cycle(source, work.steps):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return result(clock, start, work)


def _fit(work: Workload, mode: str, make_callbacks: Callable[[], list[Any]], progress: bool = True,
         module_class: type[TinyMLP] = TinyMLP) -> RunResult:
    """Times one `Trainer.fit` in a throwaway project folder (logs and checkpoints go there)."""
    clock = work.clock()
    project = tempfile.mkdtemp(prefix="fittrain-bench-")
    try:
        trainer = Trainer(callbacks=make_callbacks(), max_steps=work.steps, project_dir=project,
                          enable_progress_bar=progress)
        module = module_class()
        module.load_state_dict(work.init_state)  # the shared initial weights, as work.model() gives
        loader = work.source(mode, clock)
        # The progress bar (stderr) and its start and end lines (stdout) would flood the table; a real
        # terminal costs more, not less.
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            start = work.now()
            trainer.fit(module, loader)
            return result(clock, start, work)
    finally:
        shutil.rmtree(project, ignore_errors=True)


def run_trainer(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` with no callbacks: the loop alone, without the default progress bar either."""
    return _fit(work, mode, list, progress=False)


def run_trainer_default_bar(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` as it comes: no callbacks, the default progress bar."""
    return _fit(work, mode, list)


class LoggingMLP(TinyMLP):
    """TinyMLP logging three metrics a step as Lightning programs do: step and epoch values, on the bar."""

    def training_step(self, batch: Batch) -> torch.Tensor:
        loss = super().training_step(batch)
        for name in ("loss_a", "loss_b", "loss_c"):
            self.log(name, loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss


def run_trainer_self_log(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` with the default progress bar, the module logging 3 metrics a step
    (`on_step=True, on_epoch=True, prog_bar=True`)."""
    return _fit(work, mode, list, module_class=LoggingMLP)


def run_trainer_logger(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` with `Logger(every_n_steps=50)` (TensorBoard and progress bar on)."""
    from fittrain.callbacks import Logger

    return _fit(work, mode, lambda: [Logger(every_n_steps=LOGGER_EVERY)])


def run_trainer_logger_ckpt(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` with Logger(every_n_steps=50) and Checkpointer(every_n_steps=500)."""
    from fittrain.callbacks import Checkpointer, Logger

    return _fit(work, mode, lambda: [Logger(every_n_steps=LOGGER_EVERY),
                                     Checkpointer(every_n_steps=CHECKPOINT_EVERY)])


def run_trainer_trackers_best(work: Workload, mode: str) -> RunResult:
    """`Trainer.fit` with a Logger writing TensorBoard and CSV every 50 steps and a best-checkpoint
    Checkpointer (monitor train_loss, top 2) every 500."""
    from fittrain.callbacks import Checkpointer, Logger

    return _fit(work, mode, lambda: [Logger(every_n_steps=LOGGER_EVERY, log_with=["tensorboard", "csv"]),
                                     Checkpointer(every_n_steps=CHECKPOINT_EVERY, monitor="train_loss", save_top_k=2)])


def run_hf_accelerate(work: Workload, mode: str) -> RunResult:
    """Hugging Face Accelerate's loop: the same code with `from accelerate import Accelerator`."""
    from accelerate import Accelerator as HFAccelerator

    clock = work.clock()
    accelerator = HFAccelerator(cpu=True)
    model = work.model()
    optimizer = model.configure_optimizers()
    if mode == "loader":
        model, optimizer, source = accelerator.prepare(model, optimizer, work.loader(clock))
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        source = TimedList(work.batches, clock)
    start = work.now()
    for x, y in cycle(source, work.steps):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return result(clock, start, work)


def _fit_lightning_style(work: Workload, mode: str, pl: Any, log: bool) -> RunResult:
    """One fit by a Lightning program through the namespace `pl` (lightning.pytorch or fittrain.lightning:
    the same code, the import changed), with logger, checkpointing, progress bar and summary off; with
    `log`, the module logs 3 metrics a step (`on_step=True, on_epoch=True, prog_bar=True`)."""

    class LitMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = work.model()

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
            loss = self.inner.training_step(batch)
            if log:
                for name in ("loss_a", "loss_b", "loss_c"):
                    self.log(name, loss, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self.inner.configure_optimizers()

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its banners would interleave with the table
    clock = work.clock()
    project = tempfile.mkdtemp(prefix="fittrain-bench-")
    try:
        trainer = pl.Trainer(max_steps=work.steps, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=project)
        loader = work.source(mode, clock)
        module = LitMLP()
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # start and end lines
            start = work.now()
            trainer.fit(module, loader)
            return result(clock, start, work)
    finally:
        shutil.rmtree(project, ignore_errors=True)


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    return pl


def run_lightning(work: Workload, mode: str) -> RunResult:
    """Lightning's Trainer with logger, checkpointing, progress bar and summary off."""
    return _fit_lightning_style(work, mode, _lightning(), log=False)


def run_lightning_self_log(work: Workload, mode: str) -> RunResult:
    """Lightning's Trainer as above, the module logging 3 metrics a step (step and epoch, prog_bar)."""
    return _fit_lightning_style(work, mode, _lightning(), log=True)


def run_fittrain_lightning(work: Workload, mode: str) -> RunResult:
    """The Lightning program of `run_lightning` with its import changed to fittrain.lightning."""
    return _fit_lightning_style(work, mode, fittrain_lightning, log=False)


def run_fittrain_lightning_self_log(work: Workload, mode: str) -> RunResult:
    """The Lightning program of `run_lightning_self_log` with its import changed to fittrain.lightning."""
    return _fit_lightning_style(work, mode, fittrain_lightning, log=True)


def run_ignite(work: Workload, mode: str) -> RunResult:
    """Ignite's `create_supervised_trainer`, which iterates any iterable (lists included).

    It runs whole epochs (the step count rounded up to one), which leaves the per-step time as is.
    """
    from ignite.engine import create_supervised_trainer

    clock = work.clock()
    model = work.model()
    optimizer = model.configure_optimizers()
    engine = create_supervised_trainer(model, optimizer, F.mse_loss)
    source = work.source(mode, clock)
    epochs = -(-work.steps // NUM_BATCHES)
    start = work.now()
    engine.run(source, max_epochs=epochs, epoch_length=NUM_BATCHES)
    return result(clock, start, work)

