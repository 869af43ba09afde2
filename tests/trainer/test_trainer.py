"""Trainer.fit: event order, skipped batches, configure_optimizers forms, metrics, resume, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.checkpoint.run_folders import run_folder
from fittrain.trainer.events import EVENT_NAMES


class Regressor(TrainModule):
    """A linear model on y = x·w; `skip` makes training_step return None for those batch values."""

    def __init__(self, optimizers: str = "plain", skip_first_feature_below: float | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.optimizers = optimizers
        self.skip_below = skip_first_feature_below
        self.seen_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        self.seen_batches += 1
        if self.skip_below is not None and x[0, 0] < self.skip_below:
            return None
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y, reduction="mean")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"plain": opt, "pair": (opt, sched), "dict": {"optimizer": opt, "lr_scheduler": sched}}[self.optimizers]


def make_loader(n: int = 16, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


class Recorder(Callback):
    """Records every event it sees, with the sync flag where it matters."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def _rec(self, name: str) -> None:
        self.events.append(name)


for _name in EVENT_NAMES:
    if _name != "on_exception":
        setattr(Recorder, _name, lambda self, trainer, _n=_name: self._rec(_n))
Recorder.on_exception = lambda self, trainer, exc: self._rec("on_exception")


def test_event_order_with_accumulation_and_validation(tmp_path):
    rec = Recorder()
    Trainer(callbacks=[rec], max_epochs=1, gradient_accumulation_steps=2, project_dir=tmp_path).fit(
        Regressor(), make_loader(n=16, batch_size=4), make_loader(n=8, batch_size=4))
    batch = ["on_train_batch_start", "on_before_backward", "on_after_backward"]
    sync = ["on_before_optimizer_step"]
    end = ["on_train_batch_end"]
    val_batch = ["on_validation_batch_start", "on_validation_batch_end"]
    expected = (["on_fit_start", "on_train_start", "on_train_epoch_start"]
                + batch + end + batch + sync + end + batch + end + batch + sync + end
                + ["on_validation_start", *val_batch, *val_batch, "on_validation_end",
                   "on_train_epoch_end", "on_train_end", "on_fit_end"])
    assert rec.events == expected


def test_global_step_counts_optimizer_steps_and_lr_follows_scheduler(tmp_path):
    trainer = Trainer(max_epochs=2, gradient_accumulation_steps=2, project_dir=tmp_path)
    trainer.fit(Regressor("pair"), make_loader(n=20, batch_size=4))  # 5 batches: windows of 2, 2, 1
    assert trainer.state.global_step == 6
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 6)
    assert trainer.state.epoch == 2


@pytest.mark.parametrize("form", ["plain", "pair", "dict"])
def test_configure_optimizers_forms(tmp_path, form):
    module = Regressor(form)
    before = module.net.weight.detach().clone()
    Trainer(max_steps=3, project_dir=tmp_path).fit(module, make_loader())
    assert not torch.equal(before, module.net.weight)


def test_skipped_batches_get_no_backward_and_no_step(tmp_path):
    loader = make_loader(n=16, batch_size=4)
    skip_below = 0.0  # batches whose first feature is negative are skipped
    expected_skips = sum(1 for x, _ in loader if x[0, 0] < skip_below)
    assert 0 < expected_skips < 4, "the fixture must mix skipped and trained batches"
    rec = Recorder()
    trainer = Trainer(callbacks=[rec], max_epochs=1, project_dir=tmp_path)
    with pytest.warns(UserWarning, match="skipped"):
        trainer.fit(Regressor(skip_first_feature_below=skip_below), loader)
    assert rec.events.count("on_before_backward") == 4 - expected_skips
    assert rec.events.count("on_train_batch_end") == 4
    assert trainer.state.global_step == 4 - expected_skips


def test_max_steps_stops_mid_epoch_and_neither_limit_means_one_epoch(tmp_path):
    trainer = Trainer(max_steps=3, project_dir=tmp_path)
    trainer.fit(Regressor(), make_loader(n=40, batch_size=4))
    assert trainer.state.global_step == 3
    one = Trainer(project_dir=tmp_path)
    one.fit(Regressor(), make_loader(n=12, batch_size=4))
    assert (one.state.epoch, one.state.global_step) == (1, 3)


def test_validation_metrics_average_over_samples(tmp_path):
    """val_loss is the mean over all samples, not the mean of per-batch means."""
    module = Regressor()
    val = make_loader(n=10, batch_size=4)  # batches of 4, 4, 2: unequal weights matter
    metrics = Trainer(project_dir=tmp_path).validate(module, val)
    with torch.no_grad():
        x, y = val.dataset.tensors
        expected = nn.functional.mse_loss(module(x), y).item()
    assert metrics["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_log_records_metrics_and_train_loss(tmp_path):
    class Logging(Regressor):
        def training_step(self, batch):
            loss = super().training_step(batch)
            self.log("double", loss * 2)
            return {"loss": loss}

    trainer = Trainer(max_epochs=1, project_dir=tmp_path)
    trainer.fit(Logging(), make_loader())
    metrics = trainer.state.metrics
    assert metrics["double"] == pytest.approx(2 * metrics["train_loss"])
    assert metrics["train_loss"] == pytest.approx(trainer.state.loss.item())


def test_hook_exception_keeps_type_gains_note_and_fires_on_exception(tmp_path):
    class Boom(Callback):
        def on_train_batch_end(self, trainer):
            raise KeyError("boom")

    rec = Recorder()
    with pytest.raises(KeyError) as info:
        Trainer(callbacks=[rec, Boom()], project_dir=tmp_path).fit(Regressor(), make_loader())
    assert any("Boom.on_train_batch_end" in note for note in info.value.__notes__)
    assert rec.events[-1] == "on_exception"
    assert "on_fit_end" not in rec.events


def test_resume_continues_at_the_saved_step(tmp_path, capsys):
    class SaveAt(Callback):
        def on_train_batch_end(self, trainer):
            if trainer.state.global_step == 3 and trainer.state.batch_idx == 2:
                trainer.accelerator.save_state()

    full = Regressor()
    torch.manual_seed(0)
    Trainer(callbacks=[SaveAt()], max_epochs=2, project_dir=tmp_path).fit(full, make_loader(shuffle=True))
    resumed = Regressor()
    torch.manual_seed(123)  # a different seed: everything must come from the checkpoint
    checkpoint = run_folder(tmp_path) / "checkpoint_0"  # the first fit's run folder
    trainer = Trainer(max_epochs=2, project_dir=tmp_path, resume_from=checkpoint)
    trainer.fit(resumed, make_loader(shuffle=True))
    assert trainer.state.global_step == 8
    assert torch.equal(full.net.weight, resumed.net.weight)
    assert resumed.seen_batches == 5  # the 3 consumed batches were not replayed
    # A resume says what it loaded, in one line.
    line = f"Resumed from {checkpoint}: epoch 0, optimizer step 3, 3 batches into the epoch."
    assert capsys.readouterr().out.splitlines().count(line) == 1


def test_bad_arguments_name_argument_and_value():
    for kwargs, name in [({"max_epochs": 0}, "max_epochs"), ({"gradient_accumulation_steps": 0},
                         "gradient_accumulation_steps"), ({"max_steps": -1}, "max_steps"),
                         ({"val_every_n_epochs": 0}, "val_every_n_epochs")]:
        with pytest.raises(ValueError, match=rf"{name}=") as info:
            Trainer(**kwargs)
        assert repr(list(kwargs.values())[0]) in str(info.value)
    with pytest.raises(ValueError, match="'zero'"):
        Trainer(strategy="zero")


def test_callback_typo_is_rejected_with_valid_names():
    class Typo(Callback):
        def on_train_batch_ends(self, trainer):
            pass

    with pytest.raises(ValueError, match="on_train_batch_ends") as info:
        Trainer(callbacks=[Typo()])
    assert "on_train_batch_end" in str(info.value)
    with pytest.raises(TypeError, match="Callback"):
        Trainer(callbacks=[object()])


@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(3), ValueError, "training_step"),
    ({"not_loss": torch.tensor(1.0)}, ValueError, "training_step"),
    ("loss", TypeError, "training_step"),
])
def test_bad_training_step_returns(tmp_path, bad, error, match):
    class Bad(Regressor):
        def training_step(self, batch):
            return bad

    with pytest.raises(error, match=match):
        Trainer(project_dir=tmp_path).fit(Bad(), make_loader())


def test_empty_loader_missing_resume_and_missing_configure_optimizers(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        Trainer(project_dir=tmp_path).fit(Regressor(), DataLoader(TensorDataset(torch.zeros(0, 3)), batch_size=2))
    missing = tmp_path / "checkpoints" / "checkpoint_9"
    module = Regressor()
    before = module.net.weight.detach().clone()
    with pytest.raises(FileNotFoundError, match="checkpoint_9"):
        Trainer(project_dir=tmp_path, resume_from=missing).fit(module, make_loader())
    assert torch.equal(before, module.net.weight)

    class NoOptim(TrainModule):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def training_step(self, batch):
            return self.w.sum()

    with pytest.raises(NotImplementedError, match="configure_optimizers"):
        Trainer(project_dir=tmp_path).fit(NoOptim(), make_loader())


def test_unloadable_callback_state_fails_at_save_naming_the_callback(tmp_path):
    import numpy as np

    class NumpyState(Callback):
        def state_dict(self):
            return {"best": np.float64(1.0)}  # numpy scalars need unpickling: refused on load

        def on_train_epoch_end(self, trainer):
            trainer.accelerator.save_state()

    with pytest.raises(TypeError, match="NumpyState.state_dict"):
        Trainer(callbacks=[NumpyState()], project_dir=tmp_path).fit(Regressor(), make_loader())
    assert not list(tmp_path.glob("checkpoints/*/checkpoint_0"))


def test_repeated_validate_prepares_the_loader_once(tmp_path):
    trainer = Trainer(project_dir=tmp_path)
    module, val = Regressor(), make_loader(n=8)
    first = trainer.validate(module, val)
    assert trainer.validate(module, val) == first
    assert len(trainer.accelerator.prepared.dataloaders) == 1


@pytest.mark.parametrize("form", ["list", "lists", "lightning_dict"])
def test_lightning_forms_of_configure_optimizers(tmp_path, form):
    """Lightning's lists of one (`[opt]`, `[opt], [sched]`) and its scheduler dict with a name work."""

    class Lightning(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"list": [opt], "lists": ([opt], [sched]),
                    "lightning_dict": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch",
                                                                          "frequency": 1, "name": "lr"}}}[form]

    trainer = Trainer(max_epochs=2, project_dir=tmp_path)
    trainer.fit(Lightning(), make_loader(n=8, batch_size=4))  # 2 optimizer steps an epoch
    halvings = {"list": 0, "lists": 4, "lightning_dict": 2}[form]
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** halvings)
