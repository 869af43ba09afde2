"""A fittrain.lightning program that trains 3 epochs uninterrupted, then again interrupted after a
mid-epoch checkpoint and resumed from it with `fit(ckpt_path=...)` in a new Trainer, and writes both
ends to OUT/rank{r}.json (run by tests/lightning/test_lightning_namespace_ddp.py on 2 processes)."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import fittrain.lightning as pl
from fittrain.lightning.callbacks import ModelCheckpoint

OUT = os.path.abspath(sys.argv[1])


class Noisy(pl.LightningModule):
    """Draws from the global RNG in every step (dropout): a resume must restore each process's stream."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def run(root: str, max_epochs: int, max_steps: int = -1, ckpt_path: str | None = None, every: int | None = None):
    pl.seed_everything(5)
    x = torch.randn(72, 3)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    callbacks = [ModelCheckpoint(every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = pl.Trainer(max_epochs=max_epochs, max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp",
                         default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(every), callbacks=callbacks)
    model = Noisy()
    trainer.fit(model, DataLoader(data, batch_size=6, shuffle=True), ckpt_path=ckpt_path)
    return trainer, model


def main() -> None:
    full, full_model = run(os.path.join(OUT, "full"), 3)
    cut, _ = run(os.path.join(OUT, "cut"), 3, max_steps=8, every=4)  # 6 steps an epoch: saved mid-epoch 2
    path = os.path.join(cut.checkpoint_callback.dirpath, "epoch=1-step=8.ckpt")
    resumed, resumed_model = run(os.path.join(OUT, "resumed"), 3, ckpt_path=path)

    def record(trainer, model):
        return {"weights": [p.detach().tolist() for p in model.parameters()], "step": trainer.global_step,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}

    with open(os.path.join(OUT, f"rank{full.global_rank}.json"), "w") as file:
        json.dump({"full": record(full, full_model), "resumed": record(resumed, resumed_model)}, file)


if __name__ == "__main__":
    main()
