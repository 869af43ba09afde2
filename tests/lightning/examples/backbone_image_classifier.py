# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Adapted from Lightning-AI/pytorch-lightning, examples/pytorch/basics/backbone_image_classifier.py at commit
# 7f0c3436cd3f6ad3753125672024fc415cbcb414 (the file as last changed in 1b26ac4c), for
# tests/lightning/test_lightning_examples.py: it runs this program on Lightning as it is, and on fittrain
# with `lightning.pytorch` rewritten to `fittrain.lightning` in the import lines and nowhere else.
# What was changed, and why:
# - MNIST (downloaded) -> `generated_mnist`: seeded random 1x28x28 images in [0, 1] with labels 0-9, the
#   shapes and types torchvision's MNIST with ToTensor() gives, 384 training and 64 test images instead of
#   60000 and 10000 (random_split [55000, 5000] -> [320, 64]), so that a run takes seconds offline.
# - LightningCLI (out of fittrain.lightning's scope) -> the same module, datamodule and Trainer built
#   explicitly: seed_everything(1234) first (the CLI's seed_everything_default), max_epochs=2 (the CLI
#   takes it from --trainer.max_epochs; Trainer's default is 1000), and accelerator="cpu",
#   devices=--devices, strategy="ddp" for 2 devices; no config.yaml is saved (the CLI's SaveConfigCallback).
# - cli_lightning_logo and the torchvision imports (transforms.ToTensor, now unneeded) removed.
# - Added: `write_metrics` at the end, this process's final metrics as JSON for the comparison (what
#   callback_metrics, logged_metrics and progress_bar_metrics hold after fit, callback_metrics after the last call, the
#   best checkpoint's and the log folder's paths, global_step, current_epoch, the sum of the weights).
# ruff: noqa: I001, UP045  (upstream's import grouping and typing kept as they are)
"""MNIST backbone image classifier example.

To run: python backbone_image_classifier.py --devices 1 --out DIR

"""

import argparse
import json
import os
from typing import Optional

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything


def generated_mnist(train: bool) -> TensorDataset:
    """Stands in for MNIST(..., transform=ToTensor()): (1x28x28 float image in [0, 1], int label) pairs. The
    label is the brightest of 10 pixel bands, so that it can be learnt; its own generator, as a file on disk
    would be, leaves the global random state alone."""
    generator = torch.Generator().manual_seed(0 if train else 1)
    n = 384 if train else 64
    images = torch.rand(n, 1, 28, 28, generator=generator)
    labels = images.view(n, -1)[:, :780].view(n, 10, 78).sum(-1).argmax(1)
    return TensorDataset(images, labels)


class Backbone(torch.nn.Module):
    """
    >>> Backbone()  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Backbone(
      (l1): Linear(...)
      (l2): Linear(...)
    )
    """

    def __init__(self, hidden_dim=128):
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(LightningModule):
    """
    >>> LitClassifier(Backbone())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    LitClassifier(
      (backbone): ...
    )
    """

    def __init__(self, backbone: Optional[Backbone] = None, learning_rate: float = 0.0001):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x):
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss, on_step=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        dataset = generated_mnist(train=True)
        self.mnist_test = generated_mnist(train=False)
        self.mnist_train, self.mnist_val = random_split(dataset, [320, 64], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def cli_main(args):
    seed_everything(1234)
    model = LitClassifier()
    datamodule = MyDataModule()
    trainer = Trainer(max_epochs=2, accelerator="cpu", devices=args.devices,
                      strategy="ddp" if args.devices > 1 else "auto")
    trainer.fit(model, datamodule=datamodule)
    fit_metrics = {"callback": dict(trainer.callback_metrics), "logged": dict(trainer.logged_metrics),
                   "progress_bar": dict(trainer.progress_bar_metrics),
                   "best_model_path": os.path.relpath(trainer.checkpoint_callback.best_model_path),
                   "log_dir": os.path.relpath(trainer.log_dir)}
    test_metrics = trainer.test(ckpt_path="best", datamodule=datamodule)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    print(predictions[0])
    write_metrics(args.out, trainer, model, fit_metrics, test_metrics, predictions)


def write_metrics(out, trainer, model, fit_metrics, test_metrics, predictions):
    """Writes this process's final metrics to OUT/rank{global_rank}.json (added for the comparison)."""
    record = {
        "fit_callback_metrics": {name: float(value) for name, value in fit_metrics["callback"].items()},
        "fit_logged_metrics": {name: float(value) for name, value in fit_metrics["logged"].items()},
        "fit_progress_bar_metrics": {name: float(value) for name, value in fit_metrics["progress_bar"].items()},
        "best_model_path": fit_metrics["best_model_path"],
        "log_dir": fit_metrics["log_dir"],
        "final_callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "test": test_metrics,
        "predict": {"batches": len(predictions), "first_shape": list(predictions[0].shape),
                    "sum": float(torch.cat(predictions).double().sum())},
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
    cli_main(parser.parse_args())
