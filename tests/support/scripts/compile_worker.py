"""One process of a 2-process job that fits a compiled module: `compile_worker.py --out DIR --strategy S`.

Each rank fits 2 epochs (under DDP or FSDP2) with validation and checkpoints, then resumes from a mid-run checkpoint
and fits one more epoch, counting the graphs torch.compile builds (a counting backend), and
saves what it saw. The test compares the counts with `hand_written_graphs`, the same module
compiled in a plain one-process loop.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import load_model_weights
from fittrain.checkpoint.run_folders import run_folder


class Counter:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return graph.forward


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        return self.training_step(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def loaders() -> tuple[DataLoader, DataLoader]:
    """Batches of 8 everywhere (on 2 processes: 2 train and 1 validation batch each per epoch), so
    that no smaller last batch adds a dynamic-shape graph."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    return DataLoader(data, batch_size=8, shuffle=True), DataLoader(TensorDataset(x[:16], x[:16].sum(1, keepdim=True)),
                                                                    batch_size=8)


def hand_written_graphs(strategy: str, epochs: int = 2) -> int:
    """Graphs compiled for the same module in a plain one-process loop: training, then validation.

    What is compiled is what fittrain compiles: the module's forward, and under FSDP2 instead the
    forward of each sharded unit (here the two Linear layers, fittrain's default units).
    """
    torch._dynamo.reset()
    counter, net = Counter(), Net()
    for target in [net.net[0], net.net[2]] if strategy == "fsdp" else [net]:
        target.forward = torch.compile(target.forward, backend=counter)
    optimizer = net.configure_optimizers()
    train, val = loaders()
    for _ in range(epochs):
        net.train()
        for batch in train:
            optimizer.zero_grad()
            net.training_step(batch).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            for batch in val:
                net.validation_step(batch)
    return counter.graphs


def fit(strategy: str, project: pathlib.Path, epochs: int, resume: str | None = None) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    counter = Counter()
    trainer = Trainer(compile={"backend": counter}, strategy=strategy, max_epochs=epochs, project_dir=project,
                      resume_from=resume, callbacks=[Checkpointer(every_n_steps=3)])
    train, val = loaders()
    trainer.fit(Net(), train, val)
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {"graphs": counter.graphs, "steps": trainer.state.global_step, "val_loss": trainer.state.metrics["val_loss"],
            "weights": {k: v.clone() for k, v in state.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    project = out / f"project_{args.strategy}"
    first = fit(args.strategy, project, epochs=2)
    # checkpoint_0 is after step 3 of 4 (2 per epoch): the resume starts mid-epoch 1 and runs to 3 epochs.
    checkpoint = run_folder(project) / "checkpoint_0"  # the first fit's run, which the resumed fit continues
    resumed = fit(args.strategy, project, epochs=3, resume=str(checkpoint))
    # model.safetensors, or under FSDP2 the sharded checkpoint's names (assembled from its shards)
    saved = sorted(load_model_weights(checkpoint))
    rank = torch.distributed.get_rank()
    torch.save({"first": first, "resumed": resumed, "saved_keys": saved, "world": torch.distributed.get_world_size()},
               out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
