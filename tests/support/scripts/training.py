"""The model, data and loop shared by the distributed workers and the tests' 1-process references.

A worker imports this file as a sibling module (its folder is on sys.path when run as a script);
the tests load it with `conftest.load_script`. Everything here is deterministic: the model from a
seed, the data from its own generator, and the shuffle from the DataLoader's generator, so a
2-process run and a 1-process run see the same samples in the same order.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_FEATURES = 6
LR = 0.1
MOMENTUM = 0.9


def make_dataset(n_samples: int) -> TensorDataset:
    """A noisy linear regression problem with `n_samples` rows."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_samples, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n_samples, 1, generator=g))


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP whose initial weights depend only on `seed`."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))


def make_loader(n_samples: int, batch_size: int, shuffle: bool = True) -> DataLoader:
    """A loader whose shuffle seed comes from its own generator, not from the global RNG."""
    generator = torch.Generator().manual_seed(7) if shuffle else None
    return DataLoader(make_dataset(n_samples), batch_size=batch_size, shuffle=shuffle, generator=generator)


def train(accelerator: Any, batch_size: int, n_samples: int, epochs: int = 2, shuffle: bool = True,
          on_prepared: Callable[[nn.Module, dict[str, int]], None] | None = None,
          after_backward: Callable[[nn.Module, int, bool], None] | None = None) -> dict[str, torch.Tensor]:
    """Trains `make_model()` with SGD+momentum under `accelerator` and returns its full state dict.

    The optimizer is built on the plain model before prepare() and prepared alongside it, the
    pattern that prepare must re-bind under FSDP2.

    Args:
        accelerator: A fittrain.Accelerator (any world size, strategy and accumulation).
        batch_size: The loader's batch size, i.e. per process.
        n_samples: Dataset size.
        epochs: Passes over the data.
        shuffle: Shuffle with the loader's seeded generator.
        on_prepared: Called with the prepared model and a {"batch": i} progress dict, e.g. to
            register a DDP comm hook that reads the current batch index.
        after_backward: Called with (model, batch index, sync_gradients) after each backward.

    Returns:
        The model's full state dict (on the main process under FSDP2; empty on the others).
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader(n_samples, batch_size, shuffle))
    progress = {"batch": -1}
    if on_prepared is not None:
        on_prepared(model, progress)
    for _ in range(epochs):
        for x, y in loader:
            progress["batch"] += 1
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                if after_backward is not None:
                    after_backward(model, progress["batch"], accelerator.sync_gradients)
                optimizer.step()
                optimizer.zero_grad()
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


#: The runs that the distributed workers repeat and the tests reproduce on one process with twice
#: the batch: (per-process batch size, samples, gradient_accumulation_steps). 80 samples at 2×4 a
#: round make 10 batches per rank and epoch: accumulation windows of 4, 4 and 2.
RUNS = {
    "plain": (4, 32, 1),
    "accumulate": (4, 80, 4),
}


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (a DTensor's local part), for
    `fittrain.distributed.memory_estimate` to be compared with."""
    def local(tensors: Any) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)

    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return {"parameters": local(model.parameters()), "gradients": local(p.grad for p in model.parameters()),
            "optimizer_state": local(states)}


def run_scenarios(scenarios: dict[str, Callable[[pathlib.Path], Any]]) -> None:
    """A worker's main: `--out DIR`; runs every scenario in order and saves their results to DIR/rank{r}.pt."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    results = {name: scenario(args.out) for name, scenario in scenarios.items()}
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")
