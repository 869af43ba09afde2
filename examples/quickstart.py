"""Quick start: classify the "two moons" with a TrainModule and a Trainer with all five callbacks.

Run it:                 python examples/quickstart.py
Resume the newest save: python examples/quickstart.py --resume latest
Tiny sizes:             python examples/quickstart.py --smoke   (saves to outputs/quickstart_smoke)

The data is generated (two interleaving half circles with noise), so nothing is downloaded.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, EarlyStop, GradClip, Logger, MixedPrecision


def two_moons(n: int, seed: int) -> TensorDataset:
    """Two interleaving half circles, the classic toy classification task."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(n, generator=g) * math.pi
    label = torch.randint(0, 2, (n,), generator=g)
    x = torch.where(label == 0, torch.cos(angle), 1 - torch.cos(angle))
    y = torch.where(label == 0, torch.sin(angle), 0.5 - torch.sin(angle))
    points = torch.stack([x, y], dim=1) + 0.25 * torch.randn(n, 2, generator=g)
    return TensorDataset(points, label)


class MoonClassifier(TrainModule):
    """A small MLP; training_step returns the loss, validation_step the metrics to average."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch):
        points, labels = batch
        return nn.functional.cross_entropy(self(points), labels)

    def validation_step(self, batch):
        points, labels = batch
        logits = self(points)
        return {"val_loss": nn.functional.cross_entropy(logits, labels),
                "val_acc": (logits.argmax(dim=1) == labels).float().mean()}

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-3)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)


class PrintMetrics(Callback):
    """Prints the validation metrics after each validation, on the main process."""

    def on_validation_end(self, trainer):
        if trainer.accelerator.is_main_process:
            m = trainer.state.metrics
            print(f"epoch {trainer.state.epoch}: val_loss {m['val_loss']:.4f}  val_acc {m['val_acc']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a two-moons classifier with fittrain.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--project-dir", default=None,
                        help="default: outputs/quickstart, and outputs/quickstart_smoke with --smoke")
    parser.add_argument("--resume", default=None, help="a checkpoint folder, a run folder, 'latest', or 'auto'")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 1, 64
    if args.project_dir is None:  # a smoke run never mixes with, or resumes from, a full run's checkpoints
        args.project_dir = "outputs/quickstart_smoke" if args.smoke else "outputs/quickstart"

    torch.manual_seed(0)
    train = DataLoader(two_moons(args.samples, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(two_moons(1000, seed=2), batch_size=250)
    trainer = Trainer(
        max_epochs=args.epochs,
        project_dir=args.project_dir,
        resume_from=args.resume,
        callbacks=[
            GradClip(max_norm=1.0),
            MixedPrecision("bf16"),
            Checkpointer(every_n_epochs=1, total_limit=3),
            EarlyStop(monitor="val_loss", patience=3),
            Logger(every_n_steps=20, progress_bar=False),
            PrintMetrics(),
        ],
    )
    trainer.fit(MoonClassifier(), train, val)
    if trainer.accelerator.is_main_process:
        # One folder per run, named alike under checkpoints/ and logs/; "latest" continues the run started last.
        run = trainer.run_name
        print(f"checkpoints: {args.project_dir}/checkpoints/{run}   TensorBoard logs: {args.project_dir}/logs/{run}")
        again = f"--resume latest --epochs {args.epochs + 2}"
        if args.smoke:  # --smoke would set the sizes again: name the smoke run's folder and sizes instead
            again += f" --samples {args.samples} --project-dir {args.project_dir}"
        print(f"resume with: python examples/quickstart.py {again}")


if __name__ == "__main__":
    main()
