"""A hand-written Accelerator loop that resumes mid-epoch exactly: the documented recipe.

The loop has shuffle, dropout, gradient accumulation, clipping, an LR scheduler and augmentation
noise in `__getitem__` (from train_job.py's dataset). Resuming is three lines:

    accelerator.load_state(checkpoint)                  # restores dl.position, RNGs, everything
    start_epoch = dl.position.epoch
    skip = dl.position.batches_consumed                 # batches of that epoch already trained
    for epoch in range(start_epoch, EPOCHS):
        batches = accelerator.skip_first_batches(dl, skip) if epoch == start_epoch else dl
        ...

`--save-at-step N` saves after the N-th optimizer step (and with `--exit-after-save` dies right
after); `--resume DIR` continues from a checkpoint. The final parameters go to `--result`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import safetensors.torch
import torch
import torch._dynamo  # noqa: F401  (every optimizer step imports it; see train_job.py)
from torch import nn
from torch.utils.data import DataLoader

from fittrain import Accelerator

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_job import INTERRUPTED_EXIT_CODE, NoisyDataset, seed_everything  # noqa: E402

EPOCHS = 3


class StepCounter:
    """The loop's own progress, saved in the checkpoint through register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


def train(args: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True)
    seed_everything(args.seed)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=30)
    loader = DataLoader(NoisyDataset(40, augment=True), batch_size=4, shuffle=True, num_workers=args.workers)
    model, optimizer, dl, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)

    if args.resume:
        accelerator.load_state(args.resume)
    start_epoch, skip = dl.position.epoch, dl.position.batches_consumed
    for epoch in range(start_epoch, EPOCHS):
        model.train()
        batches = accelerator.skip_first_batches(dl, skip) if epoch == start_epoch else dl
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                counter.steps += 1
                if counter.steps == args.save_at_step:
                    accelerator.save_state(args.checkpoint)
                    if args.exit_after_save:
                        os._exit(INTERRUPTED_EXIT_CODE)

    if args.result:
        params = {k: v.detach().clone().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        safetensors.torch.save_file(params, args.result)
    accelerator.end_training()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="folder for save_state")
    parser.add_argument("--save-at-step", type=int, default=0)
    parser.add_argument("--exit-after-save", action="store_true")
    parser.add_argument("--resume", help="folder for load_state")
    parser.add_argument("--result")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--wait-for", help="after importing, wait until this file exists")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args(sys.argv[1:])
    torch.set_num_threads(1)
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.01)
    train(args)


if __name__ == "__main__":
    main()
