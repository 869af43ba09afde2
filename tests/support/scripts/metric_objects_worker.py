"""One process of the torchmetrics resume job: `metric_objects_worker.py --out DIR [--elastic]`.

`Measured` (which tests/trainer/test_logged_metric_objects.py fits in its own process too) logs
torchmetrics Metrics of every kind; here on 24 samples in batches of 3. Without `--elastic`
(2 processes: 4 batches a process and epoch) it fits 2 epochs whole, then cut after 6 steps (mid
epoch 2, a checkpoint every step) and resumed, and also whole and cut with lr=0 (the same
predictions on any number of processes). With `--elastic` (1 process) it resumes that lr=0 cut
run. Each process saves the epoch metrics of every fit to DIR/rank{r}.pt (DIR/elastic.pt).
"""

from __future__ import annotations

import argparse
import pathlib
import warnings

import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Checkpointer

NAMES = ("mae_epoch", "rho", "val_mae", "mse")


class Measured(TrainModule):
    """A regression logging a sum-state metric (MAE: step and epoch) and a list-state one (Spearman's
    rank correlation, epoch only, updated without forward), MAE in validation, and MSE updated in
    each batch but logged in on_train_epoch_end only."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.net = nn.Linear(3, 1)
        self.mae = torchmetrics.MeanAbsoluteError()
        self.spearman = torchmetrics.SpearmanCorrCoef()
        self.val_mae = torchmetrics.MeanAbsoluteError()
        self.mse = torchmetrics.MeanSquaredError()
        self.steps: list[tuple[int, float]] = []  # (epoch, the step value of mae) per batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        self.mae(pred, y)
        self.log("mae", self.mae, on_step=True, on_epoch=True)
        self.spearman.update(pred.detach().flatten(), y.flatten())
        self.log("rho", self.spearman, on_step=False, on_epoch=True)
        self.mse.update(pred, y)
        self.steps.append((self.current_epoch, float(self.trainer.state.raw_metrics["mae_step"])))
        return nn.functional.mse_loss(pred, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_mae.update(self.net(x), y)
        self.log("val_mae", self.val_mae)

    def on_train_epoch_end(self):
        self.log("mse", self.mse)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader() -> DataLoader:
    x = torch.randn(24, 3, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * x[:, :1] ** 2), batch_size=3)


def fit(project: pathlib.Path, lr: float, **options) -> dict[str, float]:
    trainer = Trainer(max_epochs=2, project_dir=project, enable_progress_bar=False,
                      callbacks=[Checkpointer(every_n_steps=1)], **options)
    trainer.fit(Measured(lr), loader(), loader())
    return {name: trainer.state.metrics[name] for name in NAMES}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--elastic", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*will save all targets and predictions.*")
    if args.elastic:
        torch.save(fit(args.out / "still_cut", 0.0, resume_from="latest"), args.out / "elastic.pt")
        return
    results = {"whole": fit(args.out / "whole", 0.05)}
    fit(args.out / "cut", 0.05, max_steps=6)
    results["resumed"] = fit(args.out / "cut", 0.05, resume_from="latest")
    results["still_whole"] = fit(args.out / "still_whole", 0.0)
    fit(args.out / "still_cut", 0.0, max_steps=6)
    rank = torch.distributed.get_rank()
    torch.save(results, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
