"""A small, fully random training job that tests run in fresh processes to check exact resume.

Everything that can break an exact resume is switched on at once: shuffling, dropout, an LR
scheduler whose lr follows its step count (OneCycleLR), gradient clipping, early stopping,
gradient accumulation, augmentation noise drawn from torch, NumPy and Python's `random` inside
`__getitem__`, and deterministic ops. A resumed run seeds every RNG differently (`--seed 999`), so anything a
checkpoint fails to restore shows up as different final parameters.

Run `python tests/support/scripts/train_job.py --help` for the options. The final parameters go to
`--result` (safetensors) with a JSON summary next to it (`<result>.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

import numpy as np
import safetensors.torch
import torch
import torch._dynamo  # noqa: F401  (every optimizer step imports it; a job started early pays for it now)
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from fittrain import Callback, Trainer, TrainModule

# Exit code of a job that stopped itself right after a save, standing in for a crash.
INTERRUPTED_EXIT_CODE = 3


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class NoisyDataset(Dataset):
    """Fixed samples (independent of the global seed) plus fresh noise from three RNGs per item."""

    def __init__(self, n: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(1234 + n)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x @ torch.linspace(-1, 1, 8).unsqueeze(1)).sin() + 0.1 * torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment:
            x = x + 0.1 * torch.randn(8) + float(np.random.normal(0, 0.05)) + random.gauss(0, 0.05)
        return x, self.y[i]


class NoisyStream(IterableDataset):
    """The same samples as a stream: shuffled per epoch from (1234, epoch), split among DataLoader
    workers, with the same augmentation noise drawn while iterating, and a resumable position."""

    def __init__(self, n: int) -> None:
        self.items, self.epoch, self.done, self.start = NoisyDataset(n, augment=True), 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.items), generator=torch.Generator().manual_seed(1234 + self.epoch))
        info = get_worker_info()
        mine = order[info.id::info.num_workers] if info is not None else order
        self.done, start, self.start = self.start, self.start, 0
        for i in mine[start:].tolist():
            self.done += 1
            yield self.items[i]

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["done"]


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Dropout(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.03, weight_decay=0.01)
        # OneCycleLR computes each step's lr (and Adam's beta1) from its step count, so a scheduler state
        # that was not restored shows; a recursive one such as ExponentialLR would not (the lr is in the
        # optimizer's state too).
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=60)


class Trace(Callback):
    """Records each step's loss and each validation; optionally slows batches down and writes the
    step reached to `progress` so a test can interrupt at a chosen point.

    Its record travels in checkpoints, so a resumed run ends with the whole run's trace.
    """

    def __init__(self, progress: pathlib.Path | None, sleep: float) -> None:
        self.progress, self.sleep = progress, sleep
        self.losses: list[tuple[int, float]] = []
        self.validated: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.accelerator.sync_gradients:
            self.losses.append((trainer.state.global_step, trainer.state.loss.item()))
            if self.progress is not None:
                tmp = self.progress.with_suffix(f".tmp{os.getpid()}")  # every rank writes it
                tmp.write_text(str(trainer.state.global_step))
                os.replace(tmp, self.progress)
        if self.sleep:
            time.sleep(self.sleep)

    def on_validation_end(self, trainer: Trainer) -> None:
        self.validated.append((trainer.state.epoch, trainer.state.metrics["val_loss"]))

    def state_dict(self) -> dict:
        return {"losses": self.losses, "validated": self.validated}

    def load_state_dict(self, state: dict) -> None:
        self.losses = [tuple(x) for x in state["losses"]]
        self.validated = [tuple(x) for x in state["validated"]]


class SaveAtSteps(Callback):
    """Saves a checkpoint after the optimizer steps listed (in on_train_batch_end, before that
    epoch's validation when the step ends an epoch), and optionally dies after the n-th save."""

    def __init__(self, steps: set[int], exit_after: int | None) -> None:
        self.steps, self.exit_after, self.saved = steps, exit_after, 0

    def on_train_batch_end(self, trainer: Trainer) -> None:
        acc = trainer.accelerator
        if acc.sync_gradients and trainer.state.global_step in self.steps:
            acc.save_state()
            self.saved += 1
            if self.saved == self.exit_after:
                sys.stdout.flush()
                os._exit(INTERRUPTED_EXIT_CODE)  # no cleanup at all, like a crash


def make_callbacks(args: argparse.Namespace, trace: Trace) -> list[Callback]:
    """The built-in GradClip and EarlyStop, the trace, then whatever saves (so saves see the trace)."""
    from fittrain.callbacks import Checkpointer, EarlyStop, GradClip

    # min_delta is huge, so no validation after the first counts as an improvement: EarlyStop
    # stops after `patience` more epochs, and at the same epoch only if its counter was restored.
    callbacks: list[Callback] = [GradClip(max_norm=0.5),
                                 EarlyStop(monitor="val_loss", mode="min", patience=args.patience, min_delta=1e6),
                                 trace]
    if args.checkpoint_every:
        callbacks.append(Checkpointer(every_n_steps=args.checkpoint_every, total_limit=args.checkpoint_limit))
    steps = {int(s) for s in args.save_steps.split(",") if s}
    if steps:
        callbacks.append(SaveAtSteps(steps, args.exit_after_save))
    return callbacks


def slow_down_saves(seconds: float) -> None:
    """Makes every checkpoint file write take longer, so a kill can land inside a save."""
    from fittrain.checkpoint import CheckpointWriter

    original = CheckpointWriter._write_file  # every write_* method ends there

    def write_file(self, name, fill):
        original(self, name, fill)
        time.sleep(seconds)

    CheckpointWriter._write_file = write_file


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True,
                        help="project_dir (checkpoints go to <project>/checkpoints/<run name>)")
    parser.add_argument("--run-name", help="Trainer(run_name=...); default: the resumed run's, else a new name")
    parser.add_argument("--result", help="where to write the final parameters (safetensors)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every RNG before anything is built")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="train on NoisyStream, an IterableDataset")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--patience", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--save-steps", default="", help="comma-separated optimizer steps to save after")
    parser.add_argument("--exit-after-save", type=int, help="die (exit 3) right after this many saves")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="add Checkpointer(every_n_steps=N)")
    parser.add_argument("--checkpoint-limit", type=int, help="Checkpointer's total_limit")
    parser.add_argument("--resume", help="resume_from: a checkpoint folder or 'latest'")
    parser.add_argument("--wait-for", help="after importing, wait until this file exists before training")
    parser.add_argument("--wait-timeout", type=float, default=300.0,
                        help="seconds to wait for --wait-for (longer than any test's deadline) before giving up")
    parser.add_argument("--announce-wait", help="file to create as the wait for --wait-for starts (imports done)")
    parser.add_argument("--progress", help="file that holds the last optimizer step taken")
    parser.add_argument("--batch-sleep", type=float, default=0.0, help="seconds to sleep after each batch")
    parser.add_argument("--slow-save", type=float, default=0.0, help="seconds to sleep after each file saved")
    parser.add_argument("--exit-linger", type=float, default=0.0,
                        help="when fit exits (SystemExit), ranks other than 0 wait this long first: a slow teardown")
    parser.add_argument("--no-rng-restore", action="store_true",
                        help="negative control: skip restoring RNG states on resume (must break exactness)")
    return parser.parse_args(argv)


def build(args: argparse.Namespace, extra: tuple[Callback, ...] = ()) -> tuple[Trainer, Net, DataLoader, DataLoader]:
    """Seeds every RNG with `args.seed`, then builds the trainer (with `extra` callbacks last),
    the module and the loaders."""
    torch.use_deterministic_algorithms(True)
    seed_everything(args.seed)
    trace = Trace(pathlib.Path(args.progress) if args.progress else None, args.batch_sleep)
    if args.stream:
        train = DataLoader(NoisyStream(args.samples), batch_size=args.batch_size, num_workers=args.workers)
    else:
        train = DataLoader(NoisyDataset(args.samples, augment=True), batch_size=args.batch_size, shuffle=True,
                           num_workers=args.workers)
    val = DataLoader(NoisyDataset(16, augment=False), batch_size=8)
    trainer = Trainer(callbacks=[*make_callbacks(args, trace), *extra], max_epochs=args.epochs,
                      gradient_accumulation_steps=args.accumulate, project_dir=args.project,
                      resume_from=args.resume, run_name=args.run_name)
    return trainer, Net(), train, val


def run(args: argparse.Namespace) -> None:
    """One training run, from seeding to writing the result."""
    trainer, module, train, val = build(args)
    trainer.fit(module, train, val)
    trace = next(cb for cb in trainer.callbacks if isinstance(cb, Trace))
    if args.result and trainer.accelerator.is_main_process:
        params = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
        safetensors.torch.save_file(params, args.result)
        summary = {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
                   "should_stop": trainer.state.should_stop, "losses": trace.losses,
                   "validated": trace.validated, "lr": trainer.optimizer.param_groups[0]["lr"]}
        pathlib.Path(args.result + ".json").write_text(json.dumps(summary))
    trainer.accelerator.end_training()


def main() -> None:
    args = parse_args(sys.argv[1:])
    torch.set_num_threads(1)
    if args.wait_for:
        # Importing is most of a job's cost; a test starts the next job early and lets it train later.
        # Bounded, so a job whose test died before creating the file does not wait forever.
        deadline = time.monotonic() + args.wait_timeout
        if args.announce_wait:
            pathlib.Path(args.announce_wait).touch()
        while not os.path.exists(args.wait_for):
            if time.monotonic() > deadline:
                sys.exit(f"--wait-for {args.wait_for} did not appear within {args.wait_timeout:g} s; giving up.")
            time.sleep(0.01)
    if args.slow_save:
        slow_down_saves(args.slow_save)
    if args.no_rng_restore:
        import fittrain.checkpoint.restore

        # Patched where apply_state looks it up.
        fittrain.checkpoint.restore.restore_rng_state = lambda state: None
    try:
        run(args)
    except SystemExit:
        # torchrun signals the ranks still alive once one has exited: this rank is such a rank.
        if args.exit_linger and os.environ.get("RANK", "0") != "0":
            time.sleep(args.exit_linger)
        raise


if __name__ == "__main__":
    main()
