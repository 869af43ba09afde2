"""torchmetrics Metric objects logged the Lightning way (`self.log("acc", self.acc)`, `self.log_dict` of a
MetricCollection), run with Lightning and with fittrain.lightning: the same values, names, views, and
the same moments at which the metrics are reset (tests/lightning/lightning_programs.py compares)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from lightning_programs import assert_same, both, floats, loaders, trainer_kwargs

torchmetrics = pytest.importorskip("torchmetrics")


def _metric_objects(api: Any, root: pathlib.Path) -> dict[str, Any]:
    class Regression(api.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.train_mae = torchmetrics.MeanAbsoluteError()
            self.train_mse = torchmetrics.MeanSquaredError()
            self.val_mae = torchmetrics.MeanAbsoluteError()
            self.val_metrics = torchmetrics.MetricCollection({"val_mse": torchmetrics.MeanSquaredError(),
                                                              "val_r2": torchmetrics.R2Score()})
            self.seen: list[tuple[Any, ...]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            pred = self.net(x)
            self.train_mae(pred, y)  # forward: the batch's value is the step value
            self.log("train_mae", self.train_mae, on_step=True, on_epoch=True, prog_bar=True)
            self.train_mse.update(pred, y)  # logged in on_train_epoch_end only
            return nn.functional.mse_loss(pred, y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_mae.update(self.net(x), y)
            self.log("val_mae", self.val_mae, metric_attribute="val_mae")  # Lightning's optional hint: accepted
            self.val_metrics.update(self.net(x), y)
            self.log_dict(self.val_metrics)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_mae.update(self.net(x), y)
            self.log("test_mae", self.val_mae)

        def on_validation_epoch_end(self) -> None:
            # Not reset yet: the loop's end resets its metrics after this hook.
            self.seen.append(("val_end", float(self.val_mae.compute()), self.val_mae._update_count))

        def on_train_epoch_end(self) -> None:
            self.log("train_mse", self.train_mse)
            self.seen.append(("train_end", self.train_mae._update_count, self.train_mse._update_count))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Regression()
    # The sanity check and validation every 2 batches: each loop computes and resets its own metrics.
    trainer = api.pl.Trainer(**trainer_kwargs(root, max_epochs=2, logger=False, enable_checkpointing=False,
                                              val_check_interval=2))
    trainer.fit(module, *loaders())
    record = {"fit": floats(trainer.callback_metrics), "logged": floats(trainer.logged_metrics),
              "bar": floats(trainer.progress_bar_metrics), "seen": module.seen,
              "updates_after_fit": [m._update_count for m in (module.train_mae, module.train_mse, module.val_mae)]}
    record["test"] = trainer.test(module, loaders()[1], verbose=False)
    record["updates_after_test"] = module.val_mae._update_count
    return record


def test_logged_metric_objects_match_lightning(tmp_path: pathlib.Path) -> None:
    records = both(_metric_objects, tmp_path)
    assert_same(records)
    assert {"train_mae_step", "train_mae_epoch", "train_mse", "val_mae", "val_mse", "val_r2"} <= set(
        records["fittrain"]["logged"])
    assert records["fittrain"]["updates_after_fit"] == [0, 0, 0]


def test_on_step_for_a_metric_in_an_evaluation_loop_is_refused_naming_the_fix(tmp_path: pathlib.Path) -> None:
    import fittrain.lightning as pl

    class StepValues(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.val_mae = torchmetrics.MeanAbsoluteError()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.val_mae(self.net(x), y)
            self.log("val_mae", self.val_mae, on_step=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_epochs=1, logger=False, enable_checkpointing=False))
    with pytest.raises(ValueError, match=r"StepValues\.log\('val_mae', MeanAbsoluteError, on_step=True\) in an "
                                         r"evaluation loop: fittrain logs a Metric's compute\(\) at the loop's end "
                                         r"only\. Leave on_step out"):
        trainer.fit(StepValues(), *loaders())
