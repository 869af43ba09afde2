"""Manual optimization the Lightning way: toggle_optimizer / untoggle_optimizer / toggled_optimizer, self.print."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


def make_loader() -> DataLoader:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x), batch_size=4)


class Gan(TrainModule):
    """A generator and a discriminator, each with its own optimizer; records requires_grad per phase."""

    def __init__(self, use_context: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = nn.Linear(3, 3), nn.Linear(3, 1)
        self.discriminator.bias.requires_grad_(False)  # frozen before training: stays frozen
        self.use_context = use_context
        self.seen: list[tuple[str, bool, bool, bool]] = []

    def _record(self, phase: str) -> None:
        self.seen.append((phase, self.generator.weight.requires_grad, self.discriminator.weight.requires_grad,
                          self.discriminator.bias.requires_grad))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        g_opt, d_opt = self.optimizers()
        self.toggle_optimizer(g_opt)
        self._record("generator")
        g_loss = -self.discriminator(self.generator(x)).mean()
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        self._record("between")
        if self.use_context:
            with self.toggled_optimizer(d_opt):
                self._record("discriminator")
                d_loss = self.discriminator(self.generator(x).detach()).mean()
                self.manual_backward(d_loss)
                d_opt.step()
                d_opt.zero_grad()
            self._record("after")
        return g_loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.generator.parameters(), lr=0.1),
                torch.optim.SGD([p for p in self.discriminator.parameters()], lr=0.1)]


def test_toggling_leaves_only_the_stepping_optimizers_parameters_requiring_gradients(tmp_path):
    module = Gan(use_context=True)
    Trainer(max_steps=1, project_dir=tmp_path, enable_progress_bar=False).fit(module, make_loader())
    assert module.seen == [("generator", True, False, False), ("between", True, True, False),
                           ("discriminator", False, True, False), ("after", True, True, False)]


def test_toggling_another_object_is_refused_and_outside_fit_too(tmp_path):
    class Wrong(Gan):
        def training_step(self, batch, batch_idx):
            self.toggle_optimizer(torch.optim.SGD(self.generator.parameters(), lr=0.1))

    with pytest.raises(ValueError, match=r"toggle_optimizer\(\) takes one of self\.optimizers\(\)"):
        Trainer(max_steps=1, project_dir=tmp_path, enable_progress_bar=False).fit(Wrong(), make_loader())
    with pytest.raises(RuntimeError, match=r"toggle_optimizer\(optimizer\) needs a running Trainer\.fit"):
        Gan().toggle_optimizer(None)


def test_print_prints_on_the_main_process(tmp_path, capsys):
    class Printing(Gan):
        def on_train_end(self):
            self.print("trained", self.global_step)

    Trainer(max_steps=1, project_dir=tmp_path, enable_progress_bar=False).fit(Printing(), make_loader())
    assert capsys.readouterr().out.splitlines()[-1] == "trained 1"
