"""Data-parallel training with the Trainer: the same script on one process or many.

Run it on two processes (gloo on CPUs, NCCL on GPUs):

    fittrain launch --num_processes 2 examples/distributed.py
    torchrun --nproc_per_node 2 examples/distributed.py          # the same, with torchrun
    fittrain launch --num_processes 2 examples/distributed.py --strategy fsdp   # shard with FSDP2

or on one: `python examples/distributed.py`. Nothing in the script changes: the Accelerator reads
torchrun's environment (RANK, WORLD_SIZE, ...), wraps the model in DDP (or FSDP2), and gives
every process its own shard of each epoch. Validation metrics are averaged over all samples of
all processes, so every process sees the same `val_loss` and stops at the same epoch.

Tiny sizes:  python examples/distributed.py --smoke   (saves to outputs/distributed_smoke)
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, EarlyStop, GradClip


def make_data(samples: int, seed: int) -> TensorDataset:
    """Points in 8 dimensions, labelled by which of 4 hidden directions they lean towards most."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(samples, 8, generator=g)
    return TensorDataset(x, (x @ directions).argmax(dim=1))


class Classifier(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch):
        x, y = batch
        logits = self(x)
        return {"val_loss": nn.functional.cross_entropy(logits, y), "val_acc": (logits.argmax(1) == y).float().mean()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class Report(Callback):
    """Prints what each process does in the first epoch, then the metrics from the main process."""

    def on_fit_start(self, trainer):
        self.batches = 0

    def on_train_batch_end(self, trainer):
        self.batches += 1

    def on_train_epoch_end(self, trainer):
        acc, metrics = trainer.accelerator, trainer.state.metrics
        if trainer.state.epoch == 0:
            # Every process prints this line: each took its own share of the batches.
            print(f"[rank {acc.process_index}/{acc.num_processes}] {acc.distributed_type.value}: "
                  f"{self.batches} batches of {trainer.train_loader.batch_size} in epoch 0", flush=True)
            acc.wait_for_everyone()
        acc.print(f"epoch {trainer.state.epoch}: train_loss {metrics['train_loss']:.4f}  "
                  f"val_loss {metrics['val_loss']:.4f}  val_acc {metrics['val_acc']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="Trainer.fit on one or many processes.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp"])
    parser.add_argument("--project-dir", default=None,
                        help="default: outputs/distributed, and outputs/distributed_smoke with --smoke")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 1, 128
    if args.project_dir is None:  # a smoke run never mixes with, or resumes from, a full run's checkpoints
        args.project_dir = "outputs/distributed_smoke" if args.smoke else "outputs/distributed"

    # The same seed on every process: the model starts identical everywhere (DDP also broadcasts
    # rank 0's weights), and every process draws the same shuffle, of which it takes its share.
    torch.manual_seed(0)
    # batch_size is per process: with 2 processes each optimizer step sees 2 x 32 samples.
    train = DataLoader(make_data(args.samples, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(make_data(1000, seed=2), batch_size=100)
    trainer = Trainer(max_epochs=args.epochs, strategy=args.strategy, project_dir=args.project_dir,
                      callbacks=[GradClip(max_norm=1.0), Checkpointer(every_n_epochs=1, total_limit=2),
                                 EarlyStop(monitor="val_loss", patience=2), Report()])
    trainer.fit(Classifier(), train, val)
    acc = trainer.accelerator
    acc.print(f"done: {trainer.state.global_step} optimizer steps on {acc.num_processes} process(es); "
              f"checkpoints in {args.project_dir}/checkpoints/{trainer.run_name}")
    acc.end_training()


if __name__ == "__main__":
    main()
