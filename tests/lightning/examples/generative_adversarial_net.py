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
# Adapted from Lightning-AI/pytorch-lightning, examples/pytorch/domain_templates/generative_adversarial_net.py
# at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414 (the file as last changed in 1b26ac4c), for
# tests/lightning/test_lightning_examples.py: it runs this program on Lightning as it is, and on fittrain
# with `lightning.pytorch` rewritten to `fittrain.lightning` in the import lines and nowhere else.
# What was changed, and why:
# - lightning.pytorch.demos.mnist_datamodule.MNISTDataModule (downloads MNIST; a demo of Lightning's, not
#   an API) -> a copy here, `MNISTDataModule`, with the same defaults and loaders (batch_size 32, shuffled
#   training batches, drop_last, pin_memory) over `generated_mnist`: seeded random 1x28x28 images in [0, 1]
#   with labels 0-9, the shapes and types of MNIST with ToTensor(), 384 training images instead of 60000
#   and val_split 64 instead of 5000, so that a run takes seconds offline; num_workers 16 -> 0.
# - seed_everything(args.seed) added before the model is built (the original seeds nothing, so no two runs
#   of it agree); Trainer(accelerator="gpu", devices=1) -> accelerator="cpu", devices=--devices, and
#   max_epochs=2 (Trainer's default is 1000). On 2 devices strategy="ddp_find_unused_parameters_true", as
#   Lightning's error says for this module under "ddp" (the generator's step leaves the discriminator,
#   toggled off, without gradients).
# - on_train_epoch_end: torchvision.utils.make_grid (torchvision is no dependency here) -> the 8 samples
#   side by side with torch.cat; the grid still goes to every logger's experiment.add_image.
#   cli_lightning_logo removed.
# - Added: `write_metrics` at the end, this process's final metrics as JSON for the comparison (what
#   callback_metrics, logged_metrics and progress_bar_metrics hold after fit, callback_metrics after the last call, the
#   best checkpoint's and the log folder's paths, global_step, current_epoch, the sum of the weights).
# ruff: noqa: I001  (upstream's import grouping kept as it is)
"""To run this template just do: python generative_adversarial_net.py --devices 1 --out DIR.

After a few epochs, launch TensorBoard to see the images being generated at every batch:

tensorboard --logdir default

"""

import json
import math
import os
from argparse import ArgumentParser, Namespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning.pytorch import LightningDataModule, seed_everything
from lightning.pytorch.core import LightningModule
from lightning.pytorch.trainer import Trainer


def generated_mnist(train: bool) -> TensorDataset:
    """Stands in for MNIST(..., transform=ToTensor()): (1x28x28 float image in [0, 1], int label) pairs. The
    label is the brightest of 10 pixel bands; its own generator, as a file on disk would be, leaves the
    global random state alone."""
    generator = torch.Generator().manual_seed(0 if train else 1)
    n = 384 if train else 64
    images = torch.rand(n, 1, 28, 28, generator=generator)
    labels = images.view(n, -1)[:, :780].view(n, 10, 78).sum(-1).argmax(1)
    return TensorDataset(images, labels)


class MNISTDataModule(LightningDataModule):
    """lightning.pytorch.demos.mnist_datamodule.MNISTDataModule's defaults and loaders, on `generated_mnist`."""

    def __init__(self, val_split: int = 64, num_workers: int = 0, seed: int = 42, batch_size: int = 32) -> None:
        super().__init__()
        self.val_split = val_split
        self.num_workers = num_workers
        self.seed = seed
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        """Split the train and valid dataset."""
        dataset = generated_mnist(train=True)
        train_length = len(dataset)
        self.dataset_train, self.dataset_val = random_split(
            dataset, [train_length - self.val_split, self.val_split], generator=torch.Generator().manual_seed(42)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset_train, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, drop_last=True, pin_memory=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset_val, batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers, drop_last=True, pin_memory=True)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(generated_mnist(train=False), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers, drop_last=True, pin_memory=True)


class Generator(nn.Module):
    """
    >>> Generator(img_shape=(1, 8, 8))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Generator(
      (model): Sequential(...)
    )
    """

    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat, out_feat, normalize=True):
            layers = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(math.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z):
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    """
    >>> Discriminator(img_shape=(1, 28, 28))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Discriminator(
      (model): Sequential(...)
    )
    """

    def __init__(self, img_shape):
        super().__init__()

        self.model = nn.Sequential(
            nn.Linear(int(math.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img):
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(LightningModule):
    """
    >>> GAN(img_shape=(1, 8, 8))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    GAN(
      (generator): Generator(
        (model): Sequential(...)
      )
      (discriminator): Discriminator(
        (model): Sequential(...)
      )
    )
    """

    def __init__(
        self,
        img_shape: tuple = (1, 28, 28),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 100,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False

        # networks
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)

        self.validation_z = torch.randn(8, self.hparams.latent_dim)

        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch

        opt_g, opt_d = self.optimizers()

        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # Train generator
        # ground truth result (ie: all fake)
        # put on GPU because we created this tensor inside training_loop
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_g)
        # adversarial loss is binary cross-entropy
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator
        # Measure discriminator's ability to classify real from generated samples
        # how well can it label as real?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)

        # how well can it label as fake?
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)

        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)

        # discriminator loss is the average of these
        d_loss = (real_loss + fake_loss) / 2

        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2

        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)

        # log sampled images
        sample_imgs = self(z)
        grid = torch.cat(tuple(sample_imgs), dim=-1)
        for logger in self.loggers:
            logger.experiment.add_image("generated_images", grid, self.current_epoch)


def main(args: Namespace) -> None:
    seed_everything(args.seed)
    # ------------------------
    # 1 INIT LIGHTNING MODEL
    # ------------------------
    model = GAN(lr=args.lr, b1=args.b1, b2=args.b2, latent_dim=args.latent_dim)

    # ------------------------
    # 2 INIT TRAINER
    # ------------------------
    # If use distributed training  PyTorch recommends to use DistributedDataParallel.
    # See: https://pytorch.org/docs/stable/nn.html#torch.nn.DataParallel
    dm = MNISTDataModule()
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_epochs=2,
                      strategy="ddp_find_unused_parameters_true" if args.devices > 1 else "auto")

    # ------------------------
    # 3 START TRAINING
    # ------------------------
    trainer.fit(model, dm)
    write_metrics(args.out, trainer, model)


def write_metrics(out, trainer, model):
    """Writes this process's final metrics to OUT/rank{global_rank}.json (added for the comparison)."""
    record = {
        "fit_callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "fit_logged_metrics": {name: float(value) for name, value in trainer.logged_metrics.items()},
        "fit_progress_bar_metrics": {name: float(value) for name, value in trainer.progress_bar_metrics.items()},
        "best_model_path": os.path.relpath(trainer.checkpoint_callback.best_model_path),
        "log_dir": os.path.relpath(trainer.log_dir),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "weights_sum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "buffers_sum": float(sum(b.detach().double().sum() for b in model.buffers())),
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    parser = ArgumentParser()

    # Hyperparameters
    parser.add_argument("--lr", type=float, default=0.0002, help="adam: learning rate")
    parser.add_argument("--b1", type=float, default=0.5, help="adam: decay of first order momentum of gradient")
    parser.add_argument("--b2", type=float, default=0.999, help="adam: decay of second order momentum of gradient")
    parser.add_argument("--latent_dim", type=int, default=100, help="dimensionality of the latent space")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    main(args)
