"""The shared boring models and data: small regressions that train on the CPU in milliseconds.

Use these where a test needs *a* model or *some* data; keep a local one where its specifics are
what the test is about (dropout, scripted metrics, a logging step), and say why beside it. Every
factory is deterministic: the same arguments give the same weights and the same samples.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import TrainModule


class Regressor(TrainModule):
    """y ≈ x·w + b with one `nn.Linear`, an MSE loss and SGD; validation runs the training loss.

    Args:
        in_features: The number of input features.
        lr: The SGD learning rate.
        optimizers: When given, `configure_optimizers` returns `optimizers(self)` instead of SGD
            over the module's parameters (for tests of what configure_optimizers may return).
    """

    def __init__(self, in_features: int = 3, lr: float = 0.1,
                 optimizers: Callable[[Regressor], Any] | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(in_features, 1)
        self.lr = lr
        self.make_optimizers = optimizers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        return self.training_step(batch)

    def configure_optimizers(self) -> Any:
        if self.make_optimizers is not None:
            return self.make_optimizers(self)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def mlp(in_features: int = 4, hidden: int = 8, seed: int = 0) -> nn.Sequential:
    """Linear -> Tanh -> Linear to one output, its weights drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def regression_data(n: int = 16, in_features: int = 3, seed: int = 0) -> TensorDataset:
    """`n` samples of x ~ N(0, 1) (from a generator seeded with `seed`) and y = the sum of x's features."""
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1, keepdim=True))


def regression_loader(n: int = 16, batch_size: int = 4, shuffle: bool = False, in_features: int = 3,
                      seed: int = 0) -> DataLoader:
    """A DataLoader over `regression_data(n, in_features, seed)`."""
    return DataLoader(regression_data(n, in_features, seed), batch_size=batch_size, shuffle=shuffle)
