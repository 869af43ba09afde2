"""One process of the 2-process `Trainer.test` / `Trainer.predict` job: `eval_worker.py --out DIR`.

Saves, per rank, to DIR/rank{r}.pt: the weights evaluated, the metrics `test` returned and the
outputs `predict` returned, for a module that was not fitted and for the same module after a
2-process `fit`, over loaders of every kind on 11 samples (odd: the ranks' shares differ, and
with even batches the last round is padded). Every sample carries its index, so the test can
tell which samples `predict` returned and in which order. `evaluate` also runs on one process
in the test itself, as the reference.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset

from fittrain import Accelerator, Trainer, TrainModule

N = 11


def dataset() -> TensorDataset:
    """(index, x, y) for 11 samples, the same on every process."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 3, generator=g)
    return TensorDataset(torch.arange(N), x, torch.sin(x.sum(1, keepdim=True)))


class Stream(IterableDataset):
    """The same samples as a stream (no length)."""

    def __iter__(self):
        return iter(dataset())


def loaders() -> dict[str, Any]:
    """Every kind of loader `test` and `predict` take; none of the batch sizes divides 11."""
    data = dataset()
    idx, x, y = data.tensors
    return {"batch_size": DataLoader(data, batch_size=3),
            "batch_sampler": DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 4, False)),
            "list": [(idx[i:i + 4], x[i:i + 4], y[i:i + 4]) for i in range(0, N, 4)],  # 3 batches
            "stream": DataLoader(Stream(), batch_size=2)}


class Net(TrainModule):
    """A small MLP; test_step returns `val_loss` and `abs` and logs `logged`; predict_step returns a
    dict holding each sample's index, so the order of the outputs can be checked."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        _, x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def test_step(self, batch: Any) -> dict[str, torch.Tensor]:
        _, x, y = batch
        self.log("logged", x[:, 0].mean())
        return {"val_loss": nn.functional.mse_loss(self(x), y), "abs": (self(x) - y).abs().mean()}

    def predict_step(self, batch: Any) -> dict[str, torch.Tensor]:
        index, x, _ = batch
        return {"index": index, "out": self(x)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValidationOnly(Net):
    """No test_step: `test` falls back to validation_step, whose scalar becomes test_loss."""

    test_step = TrainModule.test_step

    def validation_step(self, batch: Any) -> torch.Tensor:
        _, x, y = batch
        return nn.functional.mse_loss(self(x), y)


def evaluate(trainer: Trainer, module: Net) -> dict[str, Any]:
    """`test` and `predict` of `module` over every loader, and `test` through validation_step."""
    fallback = ValidationOnly()
    fallback.load_state_dict(module.state_dict())
    results: dict[str, Any] = {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    for name, loader in loaders().items():
        results[f"test_{name}"] = trainer.test(module, loader)
        predicted = trainer.predict(module, loader, all_processes=True)
        results[f"predict_{name}"] = {key: value.clone() for key, value in predicted.items()}
        results[f"predict_{name}_main_only"] = trainer.predict(module, loader) is not None
    fresh = Trainer(project_dir=trainer.project_dir)
    results["fallback"] = fresh.test(fallback, loaders()["batch_size"])
    bf16 = Trainer(accelerator=Accelerator(mixed_precision="bf16", cpu=True), project_dir=trainer.project_dir)
    results["predict_bf16"] = bf16.predict(module, loaders()["batch_size"], all_processes=True)
    return results


def run(out: pathlib.Path) -> dict[str, Any]:
    """Evaluates a module that was not fitted, then the same module after fitting it on 2 processes."""
    torch.manual_seed(0)
    module = Net()
    results = {"unfitted": evaluate(Trainer(project_dir=out / "unfitted"), module)}
    trainer = Trainer(max_epochs=2, project_dir=out / "fitted")
    trainer.fit(module, DataLoader(dataset(), batch_size=2, shuffle=True))
    results["fitted"] = evaluate(trainer, module)
    results["rank"] = trainer.accelerator.process_index
    results["world"] = trainer.accelerator.num_processes
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = run(pathlib.Path(args.out))
    torch.save(result, pathlib.Path(args.out) / f"rank{result['rank']}.pt")
