"""A small GAN on 2-D data: two optimizers, stepped in turn, with manual optimization.

The real data is a ring of 8 Gaussians (generated here, nothing to download). The module sets
`self.automatic_optimization = False`, and its training_step does what Lightning's GAN examples
do, with the same names: `self.optimizers()`, `self.manual_backward(loss)`, `opt.step()`. The
Trainer still runs the loop, checkpoints both optimizers and schedulers, averages gradients
across processes, and accumulates gradients without any code here.

    python examples/gan.py                                   # one process
    fittrain launch --num_processes 2 examples/gan.py        # two (DDP; gloo on CPUs)
    python examples/gan.py --smoke                           # tiny sizes (outputs/gan_smoke)

At the end it prints how far generated samples are from the nearest of the 8 modes, and how
many modes they cover, before and after training.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip

NOISE = 8
CENTERS = torch.tensor([[2 * math.cos(2 * math.pi * k / 8), 2 * math.sin(2 * math.pi * k / 8)] for k in range(8)])


def ring(samples: int, seed: int) -> TensorDataset:
    """Points around 8 centers on a circle of radius 2, each with a little Gaussian spread."""
    g = torch.Generator().manual_seed(seed)
    which = torch.randint(0, 8, (samples,), generator=g)
    return TensorDataset(CENTERS[which] + 0.05 * torch.randn(samples, 2, generator=g))


class GAN(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False  # training_step steps both optimizers itself
        self.generator = nn.Sequential(nn.Linear(NOISE, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                           nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, n: int) -> torch.Tensor:
        return self.generator(torch.randn(n, NOISE, device=self.device))

    def training_step(self, batch):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1, device=real.device), torch.zeros(len(real), 1, device=real.device)

        # The discriminator: real samples are 1, generated ones 0 (detached: no generator gradient).
        fake = self(len(real))
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

        # The generator: make the (just updated) discriminator call its samples real.
        g_loss = bce(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log("d_loss", d_loss)
        return g_loss  # recorded as train_loss

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
        return [opt_g, opt_d]


@torch.no_grad()
def quality(module: GAN, n: int = 2000) -> tuple[float, int]:
    """(mean distance of generated samples to the nearest center, centers that at least 2% of the
    samples lie close to, within 0.5)."""
    torch.manual_seed(1)
    samples = module.generator(torch.randn(n, NOISE, device=module.device)).cpu()
    distance, nearest = torch.cdist(samples, CENTERS).min(dim=1)
    covered = int((torch.bincount(nearest[distance < 0.5], minlength=8) >= 0.02 * n).sum())
    return distance.mean().item(), covered


def main() -> None:
    parser = argparse.ArgumentParser(description="A GAN with two optimizers and manual optimization.")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 6, 2048
    project = "outputs/gan_smoke" if args.smoke else "outputs/gan"

    torch.manual_seed(0)
    module = GAN()
    before = quality(module)
    trainer = Trainer(max_epochs=args.epochs, project_dir=project,
                      callbacks=[GradClip(max_norm=5.0), Checkpointer(every_n_epochs=args.epochs)])
    trainer.fit(module, DataLoader(ring(args.samples, seed=1), batch_size=64, shuffle=True))
    after = quality(module)
    acc = trainer.accelerator
    metrics = trainer.state.metrics
    acc.print(f"{acc.num_processes} process(es), {trainer.state.global_step} steps, 2 optimizers: "
              f"g_loss {metrics['train_loss']:.3f}  d_loss {metrics['d_loss']:.3f}")
    acc.print(f"distance to the nearest mode: {before[0]:.3f} before training, {after[0]:.3f} after; "
              f"modes covered: {before[1]}/8 before, {after[1]}/8 after")
    acc.print(f"checkpoints (both optimizers inside): {project}/checkpoints/{trainer.run_name}")


if __name__ == "__main__":
    main()
