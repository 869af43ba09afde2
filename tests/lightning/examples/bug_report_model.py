# Lightning-AI/pytorch-lightning is licensed under the Apache License, Version 2.0; this file of it carries no
# header of its own. http://www.apache.org/licenses/LICENSE-2.0
#
# Adapted from Lightning-AI/pytorch-lightning, examples/pytorch/bug_report/bug_report_model.py (the boring
# model that Lightning's bug reports start from) at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414 (the
# file as last changed in 1b26ac4c), for tests/lightning/test_lightning_examples.py: it runs this program on
# Lightning as it is, and on fittrain with `lightning.pytorch` rewritten to `fittrain.lightning` in the
# import lines and nowhere else.
# What was changed, and why:
# - seed_everything(0) added first (the original seeds nothing, so its random data and weights differ on
#   every run); Trainer(...) gains accelerator="cpu", devices=--devices and strategy="ddp" for 2 devices.
#   Its sizes are the original's (it downloads nothing).
# - Added: `write_metrics` at the end, this process's final metrics as JSON for the comparison (what
#   callback_metrics, logged_metrics and progress_bar_metrics hold after fit, callback_metrics after the last call, the
#   best checkpoint's and the log folder's paths, global_step, current_epoch, the sum of the weights).
# ruff: noqa: I001  (upstream's import grouping kept as it is)
import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, Dataset

from lightning.pytorch import LightningModule, Trainer, seed_everything


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("valid_loss", loss)

    def test_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("test_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def run(args):
    seed_everything(0)
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)

    model = BoringModel()
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
    )
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    fit_metrics = {"callback": dict(trainer.callback_metrics), "logged": dict(trainer.logged_metrics),
                   "progress_bar": dict(trainer.progress_bar_metrics),
                   "best_model_path": os.path.relpath(trainer.checkpoint_callback.best_model_path),
                   "log_dir": os.path.relpath(trainer.log_dir)}
    test_metrics = trainer.test(model, dataloaders=test_data)
    write_metrics(args.out, trainer, model, fit_metrics, test_metrics)


def write_metrics(out, trainer, model, fit_metrics, test_metrics):
    """Writes this process's final metrics to OUT/rank{global_rank}.json (added for the comparison)."""
    record = {
        "fit_callback_metrics": {name: float(value) for name, value in fit_metrics["callback"].items()},
        "fit_logged_metrics": {name: float(value) for name, value in fit_metrics["logged"].items()},
        "fit_progress_bar_metrics": {name: float(value) for name, value in fit_metrics["progress_bar"].items()},
        "best_model_path": fit_metrics["best_model_path"],
        "log_dir": fit_metrics["log_dir"],
        "final_callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "test": test_metrics,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "weights_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", default=".")
    run(parser.parse_args())
