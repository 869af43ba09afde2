"""Lightning's logging habits in evaluation steps: log the loss with self.log and return it too."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


def make_loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def mean_error(net: nn.Module, loader: DataLoader) -> float:
    """The per-sample mean of |net(x) - y| over the loader (batches of unequal size weighted by size)."""
    with torch.no_grad():
        errors = torch.cat([(net(x) - y).abs().flatten() for x, y in loader])
    return float(errors.mean())


class LogsAndReturns(TrainModule):
    """Logs each evaluation loss and returns twice that: the logged value is the one recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def _loss(self, batch):
        x, y = batch
        return (self.net(x) - y).abs().mean()

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return 2 * loss

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_logged_loss_that_is_also_returned_is_recorded_once_as_logged(tmp_path):
    module, loader = LogsAndReturns(), make_loader()
    trainer = Trainer(max_epochs=1, project_dir=tmp_path)
    trainer.fit(module, loader, loader)
    assert trainer.state.metrics["val_loss"] == pytest.approx(mean_error(module.net, loader), rel=1e-5)
    # Before, test_step's returned scalar became 'val_loss' and then 'test_loss' beside the logged one:
    # a ValueError about 'val_loss', a name this test_step never used.
    assert trainer.test(module, loader) == pytest.approx({"test_loss": mean_error(module.net, loader)}, rel=1e-5)


def test_a_test_steps_scalar_return_alone_is_test_loss(tmp_path):
    class Returns(LogsAndReturns):
        def test_step(self, batch, batch_idx):
            return self._loss(batch)

    module, loader = Returns(), make_loader()
    assert Trainer(project_dir=tmp_path).test(module, loader) == pytest.approx(
        {"test_loss": mean_error(module.net, loader)}, rel=1e-5)
