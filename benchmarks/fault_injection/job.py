"""The training job (the ``_job`` role): a small Trainer run that saves, gets killed and resumes.

It trains on 64 fixed samples, batch 4, shuffled (16 steps per epoch on one process, 8 on two),
with dropout so that a resume that misses the RNG state changes the result, and writes its final
weights to ``--result``. The parent follows its progress through the files `Progress` writes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer

from .children import MODULE, wait_for_file


class _JobNet(TrainModule):
    """8 -> 32 -> 1 with dropout, so a resume that misses the RNG state changes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        # SGD, not Adam: Adam's first step imports torch._dynamo, seconds per process.
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)


class _Progress(Callback):
    """After each optimizer step writes "<pid> <step>" to `<path>.<rank>`, then sleeps `sleep` seconds."""

    def __init__(self, path: str | None, sleep: float) -> None:
        self.path, self.sleep = path, sleep

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if self.path:
            target = f"{self.path}.{trainer.accelerator.process_index}"
            with open(f"{target}.tmp", "w") as f:
                f.write(f"{os.getpid()} {trainer.state.global_step}")
            os.replace(f"{target}.tmp", target)
        time.sleep(self.sleep)


def progress(path: pathlib.Path, rank: int) -> tuple[int, int]:
    """In the parent: (pid, optimizer step) that the job's rank last wrote; (0, -1) before its first step."""
    file = pathlib.Path(f"{path}.{rank}")
    fields = file.read_text().split() if file.exists() else []
    return (int(fields[0]), int(fields[1])) if len(fields) == 2 else (0, -1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{MODULE} _job")
    parser.add_argument("--project", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--every", type=int, default=0, help="Checkpointer(every_n_steps=...); 0: none")
    parser.add_argument("--limit", type=int, help="Checkpointer(total_limit=...)")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--result")
    parser.add_argument("--wait-for")
    parser.add_argument("--progress")
    parser.add_argument("--batch-sleep", type=float, default=0.0)
    parser.add_argument("--exit-record", help="where each rank records the SystemExit code it leaves with")
    return parser


def job_main(argv: list[str]) -> None:
    """Runs the job once --wait-for exists; writes its final weights to --result."""
    args = _parser().parse_args(argv)
    wait_for_file(args.wait_for)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    callbacks: list[Callback] = [_Progress(args.progress, args.batch_sleep)]
    if args.every:
        callbacks.append(Checkpointer(every_n_steps=args.every, total_limit=args.limit, async_save=args.async_save))
    trainer = Trainer(callbacks=callbacks, max_epochs=args.epochs, project_dir=args.project, resume_from=args.resume)
    module = _JobNet()
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=g)
    try:
        trainer.fit(module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True))
    except SystemExit as stop:
        if args.exit_record:
            pathlib.Path(f"{args.exit_record}.{os.environ.get('RANK', '0')}").write_text(str(stop.code))
        raise
    if args.result and trainer.accelerator.is_main_process:
        weights = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}
        safetensors.torch.save_file(weights, args.result, metadata={"global_step": str(trainer.state.global_step)})
    trainer.accelerator.end_training()
