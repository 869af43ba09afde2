"""One process of a 2-process DDP job that saves checkpoints in the background while training goes on.

Run under torchrun: `async_checkpoint_worker.py --out DIR`. 64 samples in batches of 4 on 2 ranks
make 8 optimizer steps per epoch; over 2 epochs it saves with `save_state(async_save=True)` after
steps 4, 8, 12 and 16 (automatic naming, total_limit=3), then once more synchronously.

Every write sleeps before its files, longer on rank 1, so rank 0's writing thread waits in its
barrier (on the checkpoint's own gloo group) while both main threads go on all-reducing
gradients on the default group. Each rank saves what it saw to DIR/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time
from typing import Any

import torch
import torch.nn.functional as F

import training
from fittrain import Accelerator, ProjectConfiguration
from fittrain.accelerator import checkpointing as checkpoint_methods
from fittrain.checkpoint import snapshot

SAVE_EVERY = 4


def slow_down_writes(rank: int, intervals: list[tuple[float, float]]) -> None:
    """Makes each write sleep before its files, and records when each whole write ran."""
    # Each name is patched where it is looked up: write_checkpoint calls snapshot.write_snapshot,
    # and save_state calls the write_checkpoint that checkpoint_methods imported.
    write_snapshot, write_checkpoint = snapshot.write_snapshot, checkpoint_methods.write_checkpoint

    def slow_snapshot(writer: Any, snapshot: Any) -> None:
        time.sleep(0.4 if rank == 1 else 0.05)
        write_snapshot(writer, snapshot)

    def timed_checkpoint(*args: Any) -> None:
        start = time.monotonic()
        write_checkpoint(*args)
        intervals.append((start, time.monotonic()))

    snapshot.write_snapshot, checkpoint_methods.write_checkpoint = slow_snapshot, timed_checkpoint


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def main(out: pathlib.Path) -> None:
    project = out / "project"
    accelerator = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True,
                                                                  total_limit=3))
    rank = accelerator.process_index
    intervals: list[tuple[float, float]] = []
    slow_down_writes(rank, intervals)
    model = training.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=training.LR, momentum=training.MOMENTUM)
    model, optimizer, loader = accelerator.prepare(model, optimizer, training.make_loader(64, 4))
    saved: dict[str, dict[str, torch.Tensor]] = {}
    step_times: list[float] = []
    step = 0
    for _ in range(2):
        for x, y in loader:
            accelerator.backward(F.mse_loss(model(x), y))  # DDP all-reduces on the default group
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            step_times.append(time.monotonic())
            if step % SAVE_EVERY == 0:
                path = pathlib.Path(accelerator.save_state(async_save=True))
                saved[path.name] = weights(model)
    final = weights(model)
    synced = pathlib.Path(accelerator.save_state())  # waits for the last background write first
    accelerator.wait_for_everyone()
    listing = sorted(os.listdir(project / "checkpoints"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    loaded = accelerator.load_state()
    result = {
        "rank": rank, "steps": step, "saved": saved, "listing": listing, "loaded": loaded,
        "after_load": weights(model), "final": final, "synced": synced.name,
        # Steps taken while a write of this process was in flight: training really went on.
        "overlapping_steps": sum(any(a < t < b for a, b in intervals) for t in step_times),
    }
    accelerator.end_training()
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    main(pathlib.Path(parser.parse_args().out))
