"""Step methods take Lightning's `(batch, batch_idx)` or fittrain's `(batch)`, decided from the signature once."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer, TrainModule


def make_loader(n: int = 12, batch_size: int = 4) -> DataLoader:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


class Indexed(TrainModule):
    """Lightning's signatures everywhere; records (method, batch_idx) in `seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.seen: list[tuple[str, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(("train", batch_idx))
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("val", batch_idx))
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def test_step(self, batch, batch_idx):
        self.seen.append(("test", batch_idx))
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("predict", batch_idx))
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_step_method_receives_its_batch_index(tmp_path):
    module, trainer = Indexed(), Trainer(max_epochs=2, project_dir=tmp_path)
    trainer.fit(module, make_loader(n=12), make_loader(n=8))
    trainer.test(module, make_loader(n=8))
    trainer.predict(module, make_loader(n=8))
    epoch = [("train", 0), ("train", 1), ("train", 2), ("val", 0), ("val", 1)]
    assert module.seen == [*epoch, *epoch, ("test", 0), ("test", 1), ("predict", 0), ("predict", 1)]


def test_a_resumed_epoch_counts_batch_idx_from_where_the_checkpoint_stopped(tmp_path):
    from fittrain.callbacks import Checkpointer

    Trainer(callbacks=[Checkpointer(every_n_steps=2)], max_steps=2, project_dir=tmp_path).fit(Indexed(), make_loader())
    resumed = Indexed()
    Trainer(callbacks=[Checkpointer(every_n_steps=2)], max_epochs=1, project_dir=tmp_path,
            resume_from="latest").fit(resumed, make_loader())
    assert resumed.seen == [("train", 2)]


@pytest.mark.parametrize("signature, call", [
    ("self", "training_step(batch)"),
    ("self, batch, batch_idx, dataloader_idx", "training_step(batch)"),
])
def test_a_step_that_can_take_neither_form_is_refused_naming_both(tmp_path, signature, call):
    namespace: dict = {}
    exec(f"def training_step({signature}):\n    return None", namespace)
    odd = type("Odd", (Indexed,), {"training_step": namespace["training_step"]})
    with pytest.raises(TypeError, match=rf"Odd\.training_step\(.*\) cannot be called as {re.escape(call)} or "
                                        r"training_step\(batch, batch_idx\)"):
        Trainer(project_dir=tmp_path).fit(odd(), make_loader())
