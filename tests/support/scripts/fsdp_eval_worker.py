"""One process of a 2-process FSDP2 job that validates and tests on a loader of uneven shares:
`fsdp_eval_worker.py --out DIR`. 10 samples in batches of 4 give rank 0 two batches and rank 1
one; under FSDP2 every forward is a collective, so the ranks must stay in step. The module also
updates a torchmetrics MeanSquaredError and logs it: the repeated batch must not count there either."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.mse = torchmetrics.MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.validation_step(batch)

    def validation_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        prediction = self(x)
        if not self.training:
            self.mse.update(prediction, y)
            self.log("mse", self.mse)
        return nn.functional.mse_loss(prediction, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def evaluate(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Net()
    trainer = Trainer(strategy=strategy, project_dir="unused")
    loader = DataLoader(data(), batch_size=4)
    return {"validate": trainer.validate(module, loader), "test": trainer.test(module, loader),
            "world": trainer.accelerator.num_processes}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    result = evaluate("fsdp")
    rank = torch.distributed.get_rank()
    torch.save(result, pathlib.Path(parser.parse_args().out) / f"rank{rank}.pt")
