"""One rank of a 2-process fit written the Lightning way: `lightning_worker.py --out DIR --strategy S`.

A DataModule whose prepare_data appends this rank to DIR/prepared.txt (so the test can count the
calls per node), a module with Lightning's step signatures and hooks. Saves, per rank, what the
module saw, its final weights and how many collectives each torch.distributed function ran during
the fit to DIR/rank{r}.pt. `--sync off` logs the same values without sync_dist, for a baseline.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import DataModule, Trainer, TrainModule


class Numbers(DataModule):
    def __init__(self, out: pathlib.Path) -> None:
        self.out = out

    def prepare_data(self) -> None:
        with open(self.out / "prepared.txt", "a", encoding="utf-8") as f:
            f.write(f"{torch.distributed.get_rank()}\n")

    def setup(self, stage: str) -> None:
        self.seen_prepared = (self.out / "prepared.txt").exists()  # prepare_data ran before any setup
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        self.train = TensorDataset(x, x.sum(1, keepdim=True))
        self.val = TensorDataset(x[:8], x[:8].sum(1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=4)


#: The torch.distributed calls fittrain makes (fittrain/distributed/collectives.py), counted during the fit.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")


def count_collectives() -> dict[str, int]:
    """Wraps each of COLLECTIVES so that every call is counted, then runs (nothing else changes)."""
    counts = dict.fromkeys(COLLECTIVES, 0)

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(torch.distributed, name, counted(name, getattr(torch.distributed, name)))
    return counts


class Net(TrainModule):
    def __init__(self, sync: bool = True) -> None:
        super().__init__()
        self.sync = sync
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.indices: list[int] = []
        self.epochs_ended = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.indices.append(batch_idx)
        rank = float(self.trainer.accelerator.process_index)
        self.log_dict({"rank_step": rank, "rank_step_too": 2 * rank}, sync_dist=self.sync)  # one collective for both
        self.log("rank_epoch", rank, on_step=False, on_epoch=True, sync_dist=self.sync)
        self.log("rank_local", rank)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def on_train_epoch_end(self) -> None:
        self.epochs_ended += 1
        self.log("rank_max", float(self.trainer.accelerator.process_index), sync_dist=self.sync, reduce_fx="max")

    def on_validation_epoch_end(self) -> None:
        self.log("epochs_so_far", float(self.current_epoch + 1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--sync", choices=("on", "off"), default="on")
    args = parser.parse_args()
    torch.manual_seed(0)
    module, data = Net(sync=args.sync == "on"), Numbers(args.out)
    trainer = Trainer(max_epochs=2, strategy=args.strategy, project_dir=str(args.out), enable_progress_bar=False)
    counts = count_collectives()
    trainer.fit(module, datamodule=data)
    counts = dict(counts)  # the fit's, not the saves' below
    rank = trainer.accelerator.process_index
    weights = {k: v.detach().clone() for k, v in trainer.accelerator.get_state_dict(trainer.model).items()}
    torch.save({"indices": module.indices, "epochs_ended": module.epochs_ended, "metrics": trainer.state.metrics,
                "seen_prepared": data.seen_prepared, "weights": weights,
                "collectives": counts}, args.out / f"rank{rank}.pt")
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
