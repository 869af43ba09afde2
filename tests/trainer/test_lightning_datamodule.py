"""DataModule (Lightning's LightningDataModule) and Lightning's loader keyword names on the Trainer."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fittrain import DataModule, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from support.models import Regressor


class Linear(Regressor):
    """The shared regressor, predicting from a batch's inputs."""

    def predict_step(self, batch):
        return self(batch[0])


class Numbers(DataModule):
    """Records its calls; `n` samples of y = sum(x), in batches of 4; keeps a counter as its state."""

    def __init__(self, n: int = 8) -> None:
        self.n, self.calls, self.loads = n, [], 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        x = torch.randn(self.n, 3, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def _loader(self, name):
        self.calls.append(name)
        return DataLoader(self.data, batch_size=4)

    def train_dataloader(self):
        return self._loader("train_dataloader")

    def val_dataloader(self):
        return self._loader("val_dataloader")

    def test_dataloader(self):
        return self._loader("test_dataloader")

    def predict_dataloader(self):
        return self._loader("predict_dataloader")

    def state_dict(self):
        return {"loads": self.loads + 1}

    def load_state_dict(self, state):
        self.loads = state["loads"]


def test_each_stage_prepares_sets_up_reads_its_loader_and_tears_down(tmp_path):
    data, module, trainer = Numbers(), Linear(), Trainer(max_epochs=1, project_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    assert "val_loss" in trainer.state.metrics  # val_dataloader was used: the module validates
    trainer.validate(module, datamodule=data)
    trainer.test(module, datamodule=data)
    assert trainer.predict(module, datamodule=data).shape == (8, 1)
    assert data.calls == [
        "prepare_data", "setup:fit", "train_dataloader", "val_dataloader", "teardown:fit",
        "prepare_data", "setup:validate", "val_dataloader", "teardown:validate",
        "prepare_data", "setup:test", "test_dataloader", "teardown:test",
        "prepare_data", "setup:predict", "predict_dataloader", "teardown:predict"]


def test_a_module_without_validation_step_ignores_the_datamodules_val_loader(tmp_path):
    class NoValidation(Linear):
        validation_step = TrainModule.validation_step

    data = Numbers()
    Trainer(project_dir=tmp_path).fit(NoValidation(), datamodule=data)
    assert "val_dataloader" not in data.calls


def test_teardown_runs_when_the_loop_raises(tmp_path):
    class Failing(Linear):
        def training_step(self, batch):
            raise RuntimeError("boom")

    data = Numbers()
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(project_dir=tmp_path).fit(Failing(), datamodule=data)
    assert data.calls[-1] == "teardown:fit"


def test_a_datamodules_state_is_saved_with_checkpoints_and_restored_on_resume(tmp_path):
    Trainer(callbacks=[Checkpointer(every_n_epochs=1)], max_epochs=1, project_dir=tmp_path).fit(
        Linear(), datamodule=Numbers())
    resumed = Numbers()
    Trainer(callbacks=[Checkpointer(every_n_epochs=1)], max_epochs=2, project_dir=tmp_path,
            resume_from="latest").fit(Linear(), datamodule=resumed)
    assert resumed.loads == 1  # the first fit's state_dict() at its checkpoint


def test_lightnings_keyword_names_for_loaders(tmp_path):
    data = Numbers()
    data.setup("fit")
    module, trainer = Linear(), Trainer(max_epochs=1, project_dir=tmp_path)
    trainer.fit(module, train_dataloaders=data.train_dataloader(), val_dataloaders=data.val_dataloader())
    assert "val_loss" in trainer.state.metrics
    assert set(trainer.validate(module, dataloaders=data.val_dataloader())) == {"val_loss"}
    assert set(trainer.test(module, dataloaders=data.test_dataloader())) == {"test_loss"}
    assert trainer.predict(module, dataloaders=data.predict_dataloader()).shape == (8, 1)


@pytest.mark.parametrize("call, message", [
    (lambda t, m, d: t.fit(m, d.train_dataloader(), train_dataloaders=d.train_dataloader()),
     r"fit\(\) received both train_loader= and train_dataloaders="),
    (lambda t, m, d: t.fit(m, d.train_dataloader(), datamodule=d), r"fit\(\) received both loaders and a datamodule"),
    (lambda t, m, d: t.fit(m), r"`train_loader` must be .*Received: train_loader=None"),
    (lambda t, m, d: t.test(m), r"Trainer\.test\(\): `loader` must be a DataLoader .*loader=None"),
    (lambda t, m, d: t.fit(m, datamodule=d.train_dataloader()),
     r"fit\(datamodule=\.\.\.\) takes a fittrain\.DataModule\. Received: .*DataLoader"),
], ids=["both-names", "loaders-and-datamodule", "no-loader", "no-test-loader", "not-a-datamodule"])
def test_loader_arguments_that_cannot_work_are_refused(tmp_path, call, message):
    data = Numbers()
    data.setup("fit")
    with pytest.raises(TypeError, match=message):
        call(Trainer(project_dir=tmp_path), Linear(), data)


def test_a_missing_loader_method_says_which_one(tmp_path):
    class TrainOnly(DataModule):
        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2)

        def teardown(self, stage):
            self.torn_down = stage

    data, trainer = TrainOnly(), Trainer(project_dir=tmp_path)
    with pytest.raises(NotImplementedError, match=r"TrainOnly defines no test_dataloader\(\), which "
                                                  r"test\(datamodule=\.\.\.\) needs"):
        trainer.test(Linear(), datamodule=data)
    assert data.torn_down == "test" and trainer.data.datamodule is None
