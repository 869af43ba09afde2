"""A tiny Trainer job for the SLURM and multi-node tests, started as plain `python slurm_train.py`
(SLURM's variables only) or under `fittrain launch` (torchrun's).

Before training, each rank records what it learnt from the environment and the result of an
all-reduce (`--facts`). `--hold-at-step N` makes every rank wait after optimizer step N until a
preemption signal reaches it (the test sends SIGUSR1 once `<project>/held.rank<R>` exists):
the ranks agree on a stop at step 10 (PreemptionWatcher.check_every), so N=10 stops exactly
there. `--pause-at-step N` makes every rank wait there once, for a test to kill one (a launcher
with --max_restarts then restarts them). `--stop-at-step N` makes rank 1 stop itself (SIGSTOP) as
step N starts; `--slow-save S` makes rank 1's first save take S seconds more, `--slow-batch-end S`
its end of step 6 (the hang watchdog's tests, with `--hang-timeout`). The main process writes the final parameters to
`--result` (torch.save).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule

HOLD_TIMEOUT = 120.0


class Net(TrainModule):
    """A small MLP with dropout; with `one_tensor`, dropout and a bias-free linear layer: one parameter.

    One parameter tensor keeps DDP's gradient bucket identical before and after DDP rebuilds its
    buckets (after the first step of every run, a resumed one included). With several tensors and
    more than 2 processes, the first step after a resume reduces in a different layout and the sums
    differ in the last bits (see /tmp/notes/clusters-ddp-bucket-rebuild.md).
    """

    def __init__(self, one_tensor: bool = False) -> None:
        super().__init__()
        if one_tensor:
            self.net = nn.Sequential(nn.Dropout(0.2), nn.Linear(4, 1, bias=False))
        else:
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def make_loader(samples: int) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, 4, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(samples, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7))


class HoldForSignal(Callback):
    """After optimizer step `step`, waits until a preemption signal has reached this rank."""

    def __init__(self, step: int, project: pathlib.Path) -> None:
        self.step, self.project = step, project

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step != self.step or not trainer.accelerator.sync_gradients:
            return
        (self.project / f"held.rank{trainer.accelerator.process_index}").touch()
        deadline = time.monotonic() + HOLD_TIMEOUT
        while not trainer.preemption.requested:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no preemption signal within {HOLD_TIMEOUT:.0f}s")
            time.sleep(0.01)


class PauseUntilKilled(Callback):
    """After optimizer step `step`, once per project (until `<project>/restarted` exists): each rank
    writes its pid to `<project>/paused.rank<R>` and waits, for the test to kill one of them, until
    the launcher stops it (its SIGTERM reaches the Trainer as a preemption request) or the test
    writes `<project>/go` (the job goes on, and finds the killed one missing at its next collective).
    With `suffix` (several pauses in one job), the files are `paused<suffix>.rank<R>`,
    `restarted<suffix>` and `go<suffix>`."""

    def __init__(self, step: int, project: pathlib.Path, suffix: str = "") -> None:
        self.step, self.project, self.suffix = step, project, suffix

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step != self.step or (self.project / f"restarted{self.suffix}").exists():
            return
        rank = trainer.accelerator.process_index
        (self.project / f"paused{self.suffix}.rank{rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_TIMEOUT
        while not trainer.preemption.requested and not (self.project / f"go{self.suffix}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not stopped within {HOLD_TIMEOUT:.0f}s")
            time.sleep(0.01)


class StopSelf(Callback):
    """Rank 1 stops its own process (SIGSTOP) as optimizer step `step` starts, after writing its pid
    to `<project>/stopped.rank1`: a rank that hangs, for the others' watchdogs to notice."""

    def __init__(self, step: int, project: pathlib.Path) -> None:
        self.step, self.project = step, project

    def on_train_batch_start(self, trainer: Trainer) -> None:
        if trainer.accelerator.process_index == 1 and trainer.state.global_step == self.step:
            (self.project / "stopped.rank1").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)


class SlowBatchEnd(Callback):
    """Rank 1 spends `seconds` in on_train_batch_end of step 6, with no collective to hold the others:
    work on one rank outside the training step, such as a main-process upload."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.accelerator.process_index == 1 and trainer.state.global_step == 6:
            time.sleep(self.seconds)


def slow_first_save(seconds: float) -> object:
    """A save_state pre-hook with which rank 1's first save takes `seconds` longer."""
    slept: list[bool] = []

    def hook(models: object, weights: object, output_dir: str) -> None:
        if int(os.environ.get("RANK", "0")) == 1 and not slept:
            slept.append(True)
            time.sleep(seconds)

    return hook


def record_facts(trainer: Trainer, path: str) -> None:
    acc = trainer.accelerator
    total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum").item()
    facts = {"rank": acc.process_index, "world_size": acc.num_processes, "local_rank": acc.local_process_index,
             "all_reduce_sum": total, "distributed_type": str(acc.distributed_type.value),
             "backend": acc.state.backend, "pid": os.getpid()}
    pathlib.Path(path.format(rank=acc.process_index)).write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--result")
    parser.add_argument("--facts", help="a path with {rank}, where each rank writes what it saw")
    parser.add_argument("--resume")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--hold-at-step", type=int)
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--pause-at-step", type=int, help="wait there to be killed, once (PauseUntilKilled)")
    parser.add_argument("--pause-at-steps", help="steps to pause at, once each: 10,18 (paused.step<S>...)")
    parser.add_argument("--one-tensor", action="store_true", help="a model with a single parameter tensor")
    parser.add_argument("--stop-at-step", type=int, help="rank 1 stops itself (SIGSTOP) there (StopSelf)")
    parser.add_argument("--slow-save", type=float, help="rank 1's first save takes this many seconds more")
    parser.add_argument("--slow-batch-end", type=float, help="rank 1's end of step 6 takes this many seconds")
    parser.add_argument("--hang-timeout", type=float, help="Trainer(hang_timeout=...) in seconds")
    args = parser.parse_args()
    project = pathlib.Path(args.project)
    project.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = []
    if args.hold_at_step:
        callbacks.append(HoldForSignal(args.hold_at_step, project))
    if args.pause_at_step:
        callbacks.append(PauseUntilKilled(args.pause_at_step, project))
    for step in filter(None, (args.pause_at_steps or "").split(",")):
        callbacks.append(PauseUntilKilled(int(step), project, f".step{step}"))
    if args.stop_at_step:
        callbacks.append(StopSelf(args.stop_at_step, project))
    if args.slow_batch_end:
        callbacks.append(SlowBatchEnd(args.slow_batch_end))
    if args.checkpoint_every:
        from fittrain.callbacks import Checkpointer

        callbacks.append(Checkpointer(every_n_steps=args.checkpoint_every))
    torch.manual_seed(999 if args.resume else 0)  # whatever a resume fails to restore shows
    trainer = Trainer(callbacks=callbacks, max_epochs=args.epochs, project_dir=project, resume_from=args.resume,
                      hang_timeout=args.hang_timeout or "auto")
    if args.slow_save:
        trainer.accelerator.register_save_state_pre_hook(slow_first_save(args.slow_save))
    if args.facts:
        record_facts(trainer, args.facts)
    module = Net(args.one_tensor)
    trainer.fit(module, make_loader(args.samples))
    if args.result and trainer.accelerator.is_main_process:
        torch.save({k: v.clone() for k, v in module.state_dict().items()}, args.result)
        pathlib.Path(f"{args.result}.json").write_text(json.dumps({"global_step": trainer.state.global_step}))


if __name__ == "__main__":
    main()
