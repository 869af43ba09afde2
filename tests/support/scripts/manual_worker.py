"""One process of a 2-process manual-optimization job: `manual_worker.py --out DIR --strategy S`.

A two-optimizer module (a tiny GAN: generator and discriminator, each with its own optimizer and
scheduler) trained with `automatic_optimization = False` under DDP or FSDP2, with gradient
accumulation and GradClip. The noise comes with the data, so a 1-process run on the same global
batches (the reference, run in the test process) computes the same gradients. Each rank saves to
DIR/rank{r}.pt the final weights of an uninterrupted run and of a run resumed from its
checkpoint after step 2. `--toggle` steps the generator inside `self.toggled_optimizer(opt_g)`, as
Lightning's GAN example does, so its backward leaves the discriminator without gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, ProjectConfiguration, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip
from fittrain.checkpoint.run_folders import run_folder

STEPS = 4


class TinyGAN(TrainModule):
    """Generator and discriminator, stepped in turn; the discriminator runs three times a batch."""

    def __init__(self, toggle: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any) -> torch.Tensor:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(noise)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        sched_d.step()
        with self.toggled_optimizer(opt_g) if self.toggle else contextlib.nullcontext():
            g_loss = bce(self.discriminator(fake), ones)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            sched_g.step()
        return g_loss

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in (opt_g, opt_d)]
        return [opt_g, opt_d], scheds


def data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 2, generator=g) + 2.0, torch.randn(n, 2, generator=g))


def fit(batch_size: int, project_dir: str, strategy: str = "auto", resume_from: str | None = None,
        mixed_precision: str = "no", toggle: bool = False) -> dict[str, Any]:
    """STEPS optimizer steps (accumulation 2), saving a checkpoint after every second step."""
    torch.manual_seed(0)
    module = TinyGAN(toggle)
    accelerator = Accelerator(gradient_accumulation_steps=2, strategy=strategy, mixed_precision=mixed_precision,
                              project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
    trainer = Trainer(max_steps=STEPS, accelerator=accelerator, resume_from=resume_from,
                      callbacks=[GradClip(max_norm=0.5), Checkpointer(every_n_steps=2)])
    trainer.fit(module, DataLoader(data(), batch_size=batch_size))
    # Every rank gathers the full tensors (FSDP2 shards them), in the same order.
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in module.state_dict().items()}
    return {"weights": weights, "global_step": trainer.state.global_step,
            "lrs": [s.get_last_lr()[0] for s in trainer.schedulers],
            "rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--toggle", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    result = fit(batch_size=4, project_dir=str(out / "run"), strategy=args.strategy, toggle=args.toggle)
    result["resumed"] = fit(batch_size=4, project_dir=str(out / "resumed"), strategy=args.strategy,
                            resume_from=str(run_folder(out / "run") / "checkpoint_0"), toggle=args.toggle)
    torch.save(result, out / f"rank{result['rank']}.pt")
