"""A small Lightning program for 2 processes, run by tests/lightning/test_lightning_namespace_ddp.py with Lightning
(`python ddp_program.py lightning OUT`: its Trainer(devices=2) starts the second process) and with
fittrain.lightning (`fittrain launch --num_processes 2 ddp_program.py fittrain OUT`). Each process writes
what a program can observe to OUT/rank{global_rank}.json: metrics logged with and without sync_dist,
gradient norms (Lightning's grad_norm), what a rank_zero_only function returned, EarlyStopping's
decision, test and predict results, the folders, and the files rank 0 wrote."""

import datetime
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

if sys.argv[1] == "lightning":
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import grad_norm, rank_zero_info, rank_zero_only
    from lightning.pytorch.utilities.types import STEP_OUTPUT
else:
    import fittrain.lightning as pl
    from fittrain.lightning.callbacks import EarlyStopping, ModelCheckpoint
    from fittrain.lightning.loggers import CSVLogger
    from fittrain.lightning.strategies import DDPStrategy
    from fittrain.lightning.utilities import grad_norm, rank_zero_info, rank_zero_only
    from fittrain.lightning.utilities.types import STEP_OUTPUT

OUT = os.path.abspath(sys.argv[2])


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx) -> STEP_OUTPUT:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        self.log("rank_loss", loss)  # this process's own
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))  # the gradients DDP averaged: alike on both processes

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss)  # each process's own mean, as in Lightning
        self.log("val_loss_sync", loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@rank_zero_only
def on_rank_zero() -> str:
    rank_zero_info("only rank 0 says this")
    return "ran"


def main() -> None:
    pl.seed_everything(3)
    x = torch.randn(70, 3)
    data = TensorDataset(x, x.sum(1, keepdim=True) + 0.2 * torch.randn(70, 1))
    stop = EarlyStopping("val_loss", patience=1, mode="max")
    best = ModelCheckpoint(monitor="val_loss_sync", filename="{epoch}-{val_loss_sync:.3f}")
    # A strategy object, as many programs pass: DDP's own arguments and the process group's.
    strategy = DDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True, process_group_backend="gloo",
                           timeout=datetime.timedelta(minutes=5))
    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", devices=2, strategy=strategy, default_root_dir=OUT,
                         logger=CSVLogger(OUT), log_every_n_steps=2, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[stop, best])
    model = Regression()
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=8))
    fit = {name: float(value) for name, value in trainer.callback_metrics.items()}
    test = trainer.test(model, DataLoader(data, batch_size=16), verbose=False)
    predictions = trainer.predict(model, DataLoader(data, batch_size=16))
    record = {
        "fit": fit, "test": test, "world_size": trainer.world_size, "global_rank": trainer.global_rank,
        "is_global_zero": trainer.is_global_zero, "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch, "stopped_epoch": stop.stopped_epoch,
        "log_dir": os.path.relpath(trainer.log_dir, OUT),  # every process: Lightning's log_dir is a broadcast
        "dirpath": os.path.relpath(trainer.checkpoint_callback.dirpath, OUT),
        "best": os.path.relpath(trainer.checkpoint_callback.best_model_path, OUT),
        "predictions": [len(predictions), sum(float(p.sum()) for p in predictions), sum(len(p) for p in predictions)],
        "weights": float(sum(p.detach().double().sum() for p in model.parameters())),
        "rank_zero_only": on_rank_zero(),
    }
    if trainer.is_global_zero:
        with open(os.path.join(OUT, record["log_dir"], "metrics.csv")) as file:
            record["csv_header"] = file.readline().strip()
    with open(os.path.join(OUT, f"rank{trainer.global_rank}.json"), "w") as file:
        json.dump(record, file, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
