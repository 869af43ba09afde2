"""save_hyperparameters(): a module's __init__ arguments in hparams, trackers and checkpoints; seed_everything."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import list_checkpoints


def make_loader() -> DataLoader:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


class Net(TrainModule):
    def __init__(self, lr: float = 0.1, hidden: int = 4, activation: nn.Module | None = None, **extra) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="hidden" if extra.get("skip_hidden") else ())
        self.net = nn.Sequential(nn.Linear(3, hidden), activation or nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_the_init_arguments_are_recorded_defaults_and_extra_keywords_included():
    module = Net(lr=0.5, tag="demo")
    assert module.hparams == {"lr": 0.5, "hidden": 4, "activation": None, "tag": "demo"}
    assert module.hparams.lr == 0.5 and module.hparams.tag == "demo"
    assert "hidden" not in Net(skip_hidden=True).hparams


def test_names_pick_and_ignore_drops():
    class Picky(Net):
        def __init__(self, lr: float = 0.1, hidden: int = 4) -> None:
            TrainModule.__init__(self)
            self.save_hyperparameters("lr")

    assert Picky(lr=0.3).hparams == {"lr": 0.3}


def test_misuse_is_refused_with_the_fix():
    class Unknown(TrainModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters(ignore=["momentum"])

    with pytest.raises(ValueError, match=r"__init__ has no argument named momentum\. Its arguments: lr\."):
        Unknown()
    with pytest.raises(RuntimeError, match=r"call it inside __init__, after super\(\)\.__init__\(\)"):
        Net().save_hyperparameters()


def test_checkpoints_keep_them_and_a_resume_with_other_values_warns(tmp_path):
    Trainer(callbacks=[Checkpointer(every_n_epochs=1)], project_dir=tmp_path).fit(
        Net(lr=0.2, activation=nn.ReLU()), make_loader())
    newest = list_checkpoints(tmp_path / "checkpoints" / next(p.name for p in (tmp_path / "checkpoints").iterdir()))[-1]
    saved = torch.load(newest / "custom_checkpoint_1.pt", weights_only=True)
    assert saved["hparams:Net"] == {"lr": 0.2, "hidden": 4, "activation": "ReLU()"}
    with pytest.warns(UserWarning, match=r"Resuming Net with other hyperparameters than the checkpoint's: saved "
                                         r"\{'lr': 0.2, .*\}, now \{'lr': 0.4, "):
        Trainer(callbacks=[Checkpointer(every_n_epochs=1)], max_epochs=2, project_dir=tmp_path,
                resume_from="latest").fit(Net(lr=0.4, activation=nn.ReLU()), make_loader())


def test_seed_everything_seeds_every_generator_remembers_the_seed_and_returns_it(monkeypatch):
    import random

    import numpy as np

    from fittrain import seed_everything

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert seed_everything(7, workers=True) == 7
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    assert seed_everything() == 7  # None takes the seed remembered in PL_GLOBAL_SEED
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert seed_everything() == 0
    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 2\*\*32\).*Received: seed=-1"):
        seed_everything(-1)
    with pytest.raises(TypeError, match=r"`seed` must be an integer\. Received: seed='7'"):
        seed_everything("7")
