"""One process of a 2-process Trainer.fit job: `trainer_worker.py --out DIR`.

Saves, per rank, the final weights, the validation metrics and the trainer state to DIR/rank{r}.pt,
for a run on a DataLoader and (under "batches") one on a plain list of ready batches.
The same function runs in the test process with one process and twice the batch, as reference.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


class Net(TrainModule):
    """A small MLP; training_step calls self(x), so DDP must see the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"val_loss": nn.functional.mse_loss(self(x), y), "val_abs": (self(x) - y).abs().mean()}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def fit(batch_size: int, project_dir: str) -> dict[str, Any]:
    """Two epochs with accumulation 2 and validation on 10 samples (uneven across 2 ranks)."""
    torch.manual_seed(0)
    module = Net()
    trainer = Trainer(max_epochs=2, gradient_accumulation_steps=2, project_dir=project_dir)
    train = DataLoader(data(64, 1), batch_size=batch_size, shuffle=True)
    trainer.fit(module, train, DataLoader(data(10, 2), batch_size=4))
    trainer.accelerator.save_state()
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "metrics": trainer.state.metrics, "global_step": trainer.state.global_step,
            "rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes}


def fit_batches(merge: int, project_dir: str) -> dict[str, Any]:
    """Two epochs with accumulation 2 over a list of ready batches of 4 samples, `merge` of them
    concatenated into one, and validation on a list of 3 batches of the 10 validation samples."""
    torch.manual_seed(0)
    module = Net()
    x, y = data(64, 1).tensors
    small = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 64, 4)]
    batches = [tuple(torch.cat(parts) for parts in zip(*small[i:i + merge])) for i in range(0, len(small), merge)]
    vx, vy = data(10, 2).tensors
    trainer = Trainer(max_epochs=2, gradient_accumulation_steps=2, project_dir=project_dir)
    trainer.fit(module, batches, [(vx[i:i + 4], vy[i:i + 4]) for i in range(0, 10, 4)])
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "metrics": trainer.state.metrics, "global_step": trainer.state.global_step}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = fit(batch_size=4, project_dir=args.out)
    result["batches"] = fit_batches(merge=1, project_dir=str(pathlib.Path(args.out) / "batches"))
    torch.save(result, pathlib.Path(args.out) / f"rank{result['rank']}.pt")
