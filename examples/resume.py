"""Exact resume: a run that crashes and resumes from its checkpoint ends with the same weights.

Three runs of the same job, in this one script:

1. the reference: trains without interruption;
2. the same job, with a callback that raises after step `--crash-at`, standing in for a crash
   (a killed job, a preempted node); a Checkpointer saved every `--save-every` steps before that;
3. a fresh module and a fresh Trainer with `resume_from="latest"`, which finish the job.

The job has everything that makes resuming hard: shuffling, dropout, an LR schedule that changes
every step, gradient clipping and an epoch that is interrupted in its middle. Run 3 starts from
other random weights and another global seed, so only what the checkpoint restores can make it
match. On the CPU with deterministic ops the final weights are bitwise equal (`torch.equal`).

Run it:      python examples/resume.py
Tiny sizes:  python examples/resume.py --smoke
"""

import argparse
import pathlib
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip
from fittrain.checkpoint.run_folders import run_checkpoints


class Regressor(TrainModule):
    """A small MLP with dropout, trained with AdamW and a cosine schedule stepped every step."""

    def __init__(self, total_steps: int) -> None:
        super().__init__()
        self.total_steps = total_steps
        self.net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)


class SimulatedCrash(Exception):
    """What CrashAfter raises."""


class CrashAfter(Callback):
    """Raises after optimizer step `step`, as if the process had been killed there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer):
        if trainer.state.global_step == self.step:
            raise SimulatedCrash(f"simulated crash after step {self.step}")


def make_loader(samples: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=g)
    y = (x ** 2).sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def run(project_dir: pathlib.Path, args: argparse.Namespace, seed: int, callbacks: list,
        resume_from: str | None = None) -> Regressor:
    """Builds everything from scratch (as a new process would) and fits."""
    torch.manual_seed(seed)
    loader = make_loader(args.samples)
    module = Regressor(total_steps=args.epochs * len(loader))
    trainer = Trainer(max_epochs=args.epochs, project_dir=project_dir, resume_from=resume_from,
                      callbacks=[GradClip(max_norm=1.0), *callbacks])
    trainer.fit(module, loader)
    print(f"  finished at epoch {trainer.state.epoch}, step {trainer.state.global_step}")
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description="Interrupt a run, resume it, compare with an uninterrupted run.")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--save-every", type=int, default=10, help="Checkpointer(every_n_steps=...)")
    parser.add_argument("--crash-at", type=int, default=45, help="the step after which run 2 crashes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples, args.save_every, args.crash_at = 2, 64, 3, 7  # 4 steps per epoch
    torch.use_deterministic_algorithms(True)

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        print("1. uninterrupted run")
        reference = run(root / "reference", args, seed=0, callbacks=[])

        print(f"2. the same run, saving every {args.save_every} steps, crashing after step {args.crash_at}")
        try:
            run(root / "job", args, seed=0,
                callbacks=[Checkpointer(every_n_steps=args.save_every), CrashAfter(args.crash_at)])
        except SimulatedCrash as crash:
            print(f"  {crash}")
        saved = [p.name for p in run_checkpoints(root / "job")]  # the run's folder, checkpoints/<run name>
        print(f"  checkpoints on disk: {', '.join(saved)}")

        print("3. a fresh Trainer (other seed, other initial weights) resumes from 'latest'")
        # The callback list matches run 2's, minus the crash: callback states are matched by position and class.
        resumed = run(root / "job", args, seed=1234, callbacks=[Checkpointer(every_n_steps=args.save_every)],
                      resume_from="latest")

    ref_state, res_state = reference.state_dict(), resumed.state_dict()
    equal = all(torch.equal(ref_state[k], res_state[k]) for k in ref_state)
    print(f"final weights equal to the uninterrupted run's (torch.equal): {equal}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
