"""Accelerate's configuration objects on 2 processes; each rank writes what it saw to {out}/rank{r}.pt.

- find_unused: DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16") lets a
  model with a branch unused by the loss train (plain DDP raises), and the ranks stay equal.
- sync_each_batch: the gradients after the first batch of a window of 2 are already averaged
  (equal on both ranks) with GradientAccumulationPlugin(sync_each_batch=True), local without.
- trigger: under no_sync, a backward inside trigger_sync_in_backward averages the gradients.
- join: with even_batches=False, rank 0 has 3 batches and rank 1 two; join_uneven_inputs lets
  both finish their loops (DDP's Join shadows the collectives of the rank that ran out).
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from fittrain import Accelerator
from fittrain.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(2, 1)


def _local_batch(acc: Accelerator) -> torch.Tensor:
    return torch.full((2, 2), float(acc.process_index + 1))


def find_unused() -> dict:
    acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16")])
    torch.manual_seed(0)
    model = TwoBranches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(2):
        acc.backward(model(_local_batch(acc)).sum())
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in acc.unwrap_model(model).named_parameters()}


def first_batch_grads(sync_each_batch: bool) -> torch.Tensor:
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                              sync_each_batch=sync_each_batch))
    model = acc.prepare(_model())
    with acc.accumulate(model):
        acc.backward(model(_local_batch(acc)).sum())
    return model.module.weight.grad.clone()


def trigger() -> torch.Tensor:
    acc = Accelerator()
    model = acc.prepare(_model())
    with acc.no_sync(model):
        loss = model(_local_batch(acc)).sum()
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss)
    return model.module.weight.grad.clone()


def synced_rng() -> dict:
    """rng_types=["torch"]: every pass of a prepared loader starts from process 0's global generator,
    so a draw after the first batch is the same on both ranks (each seeded differently before)."""
    acc = Accelerator(rng_types=["generator", "torch"])
    loader = acc.prepare(DataLoader(torch.ones(8, 2), batch_size=2))
    torch.manual_seed(100 + acc.process_index)
    next(iter(loader))
    return {"draw": torch.rand(3)}


def join() -> int:
    acc = Accelerator()
    model, optimizer = acc.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    loader = acc.prepare(DataLoader(torch.ones(10, 2), batch_size=2))
    steps = 0
    with acc.join_uneven_inputs([model], even_batches=False):
        for x in loader:
            acc.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


if __name__ == "__main__":
    out = sys.argv[1]
    results = {"find_unused": find_unused(), "synced": first_batch_grads(True), "local": first_batch_grads(False),
               "trigger": trigger(), "join_steps": join(), "rng": synced_rng()}
    acc = Accelerator()
    torch.save(results, f"{out}/rank{acc.process_index}.pt")
    acc.end_training()
