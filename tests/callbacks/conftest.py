"""A tiny regression TrainModule and its data, shared by the built-in callbacks' tests.

Everything runs on the CPU in milliseconds: 16 samples, 4 features, batches of 4, so one epoch
is 4 batches. Tests receive factories (`make_module`, `make_loader`) as fixtures, so each can ask
for the variant it needs without importing this file.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import TrainModule

IN_DIM = 4


class TinyRegressor(TrainModule):
    """Linear -> Tanh -> Linear on y = x·w + 0.5, trained with SGD.

    Args:
        lr: The SGD learning rate.
        val_losses: When given, `validation_step` returns `val_losses[current_epoch]` instead of
            the real loss, so a test controls exactly what EarlyStop sees.
    """

    def __init__(self, lr: float = 0.1, val_losses: Sequence[float] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_DIM, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr = lr
        self.val_losses = val_losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        if self.val_losses is not None:
            return torch.tensor(self.val_losses[self.current_epoch])
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.fixture
def make_module() -> Callable[..., TinyRegressor]:
    """Builds a TinyRegressor with the same initial weights every time."""

    def build(**kwargs: Any) -> TinyRegressor:
        torch.manual_seed(0)
        return TinyRegressor(**kwargs)

    return build


@pytest.fixture
def make_loader() -> Callable[..., DataLoader]:
    """Builds a loader over a fixed noiseless regression set (16 samples, batches of 4 by default)."""

    def build(n: int = 16, batch_size: int = 4, scale: float = 1.0) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(n, IN_DIM, generator=g)
        w = torch.randn(IN_DIM, 1, generator=g)
        return DataLoader(TensorDataset(x, (x @ w + 0.5) * scale), batch_size=batch_size)

    return build
