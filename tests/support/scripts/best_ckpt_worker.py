"""One process of a 2-process job with a best-checkpoint Checkpointer: `best_ckpt_worker.py --out DIR`.

Two fits, each into its own project under DIR, with saves (and validations) every 2 optimizer
steps and `save_top_k=2`:
- "val_loss": monitored in "min" mode with `restore_best=True`; validation metrics are averaged
  over both ranks, so every rank ranks alike.
- "train_loss": monitored in "max" mode; each rank's own training loss differs, so only the main
  process's value may rank, or the ranks would disagree.
- "fsdp": as "val_loss", with `Trainer(strategy="fsdp")`: restore_best re-shards the best weights.
Each rank saves to DIR/rank{r}.pt, per fit: the value of the metric it saw at each save, the
Checkpointer's best checkpoint and score, and the module's full weights after fit (under FSDP
gathered onto the main process; the other rank reports none).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer

EVERY = 2


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)  # large enough to wobble


class SeenAtSaves(Callback):
    """Records `monitor`'s value on this rank at every save step (it runs after the Checkpointer)."""

    def __init__(self, monitor: str) -> None:
        self.monitor, self.values, self._step = monitor, [], 0

    def on_train_batch_end(self, trainer: Trainer) -> None:
        step = trainer.state.global_step
        if step != self._step and step % EVERY == 0:
            self.values.append(trainer.state.metrics[self.monitor])
        self._step = step


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.sin(3 * x.sum(1, keepdim=True)))


def fit(project: pathlib.Path, monitor: str, mode: str, strategy: str = "auto") -> dict[str, Any]:
    """3 epochs of 4 steps per rank (32 samples, batch 4 on each of 2 ranks): 6 saves."""
    torch.manual_seed(0)
    module = Net()
    seen = SeenAtSaves(monitor)
    checkpointer = Checkpointer(every_n_steps=EVERY, monitor=monitor, mode=mode, save_top_k=2,
                                restore_best=monitor == "val_loss")
    trainer = Trainer(max_epochs=3, project_dir=project, val_every_n_steps=EVERY, callbacks=[checkpointer, seen],
                      strategy=strategy)
    # 16 validation samples: 2 batches per rank. Under FSDP every forward is a collective, so
    # ranks with unequal numbers of validation batches would wait for each other forever.
    trainer.fit(module, DataLoader(data(32, 1), batch_size=4, shuffle=True), DataLoader(data(16, 2), batch_size=4))
    return {"rank": trainer.accelerator.process_index, "seen": seen.values,
            "best_checkpoint": str(trainer.best_checkpoint), "best_score": trainer.best_score,
            "weights": {k: v.clone()
                        for k, v in trainer.accelerator.distributed_strategy.full_state_dict(module).items()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    results = {"val_loss": fit(out / "val_loss", "val_loss", "min"),
               "train_loss": fit(out / "train_loss", "train_loss", "max"),
               "fsdp": fit(out / "fsdp", "val_loss", "min", strategy="fsdp")}
    torch.save(results, out / f"rank{results['val_loss']['rank']}.pt")
