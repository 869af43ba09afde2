"""`Trainer.test` and `Trainer.predict` on one process (two processes: tests/trainer/test_test_predict_ddp.py).

Real Trainer runs on the CPU over 11 samples in batches of 4 (the batch size does not divide the
dataset), compared with the module applied to the whole dataset at once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fittrain import Accelerator, Callback, Trainer, TrainModule
from fittrain.callbacks import MixedPrecision
from fittrain.trainer.evaluation import as_test_name

N = 11


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(N, 1, generator=g))


def make_loader(batch_size: int = 4) -> DataLoader:
    return DataLoader(dataset(), batch_size=batch_size)


class Regressor(TrainModule):
    """Linear regression with a test_step returning a dict and logging a value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)
        self.autocast_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def test_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        self.log("first_feature", x[:, 0].mean())
        return {"val_loss": nn.functional.mse_loss(self(x), y), "abs": (self(x) - y).abs().mean(),
                "test_max": (self(x) - y).abs().max()}

    def predict_step(self, batch: Any) -> torch.Tensor:
        x, _ = batch
        return self(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ValidationOnly(Regressor):
    """No test_step: test runs validation_step, whose scalar is recorded as test_loss."""

    test_step = TrainModule.test_step

    def validation_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        self.log("val_first_feature", x[:, 0].mean())
        return nn.functional.mse_loss(self(x), y)


def by_hand(module: Regressor) -> dict[str, float]:
    """The metrics over the whole dataset at once; every sample counts once."""
    x, y = dataset().tensors
    with torch.no_grad():
        error = module.net(x) - y
    return {"test_loss": error.pow(2).mean().item(), "test_abs": error.abs().mean().item(),
            "test_first_feature": x[:, 0].mean().item()}


def forward_all(module: Regressor) -> torch.Tensor:
    with torch.no_grad():
        return module.net(dataset().tensors[0])


def test_test_metrics_are_averaged_over_every_sample_and_named_test(tmp_path):
    module = Regressor()
    trainer = Trainer(project_dir=tmp_path)
    metrics = trainer.test(module, make_loader())
    expected = by_hand(module)
    # test_max is a per-batch maximum, averaged like every metric; the others are whole-set means.
    assert sorted(metrics) == ["test_abs", "test_first_feature", "test_loss", "test_max"]
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert {k: trainer.state.metrics[k] for k in metrics} == pytest.approx(metrics)
    assert module.training  # eval mode only during the loop


def test_without_test_step_test_runs_validation_step(tmp_path):
    module = ValidationOnly()
    metrics = Trainer(project_dir=tmp_path).test(module, make_loader())
    expected = by_hand(module)
    assert metrics == pytest.approx({"test_loss": expected["test_loss"],
                                     "test_first_feature": expected["test_first_feature"]}, rel=1e-6)


def test_metric_names_follow_one_rule():
    assert [as_test_name(n) for n in ("val_loss", "val_acc", "acc", "test_acc", "loss", "validation")] == [
        "test_loss", "test_acc", "test_acc", "test_acc", "test_loss", "test_validation"]


def test_values_logged_in_validation_are_weighted_by_their_own_batch(tmp_path):
    # 11 samples in batches of 4, 4, 3: a logged batch mean counts as many times as its batch has samples.
    module = ValidationOnly()
    metrics = Trainer(project_dir=tmp_path).validate(module, make_loader())
    assert metrics["val_first_feature"] == pytest.approx(dataset().tensors[0][:, 0].mean().item(), rel=1e-6)


@pytest.mark.parametrize("batch_size", [4, 1, 11, 20])
def test_predict_returns_the_module_applied_to_the_whole_dataset_in_order(tmp_path, batch_size):
    module = Regressor()
    predicted = Trainer(project_dir=tmp_path).predict(module, make_loader(batch_size))
    assert predicted.shape == (N, 1) and not predicted.requires_grad
    torch.testing.assert_close(predicted, forward_all(module))  # batch-size kernels differ in the last bit
    assert module.training


def test_test_and_predict_after_fit_use_the_trained_weights(tmp_path):
    module = Regressor()
    before = forward_all(module)
    trainer = Trainer(max_epochs=2, project_dir=tmp_path)
    trainer.fit(module, DataLoader(dataset(), batch_size=4, shuffle=True))
    model = trainer.model
    predicted = trainer.predict(module, make_loader())
    metrics = trainer.test(module, make_loader())
    assert trainer.model is model  # the fitted module is not prepared again
    assert not torch.equal(predicted, before)
    torch.testing.assert_close(predicted, forward_all(module))
    assert {k: metrics[k] for k in by_hand(module)} == pytest.approx(by_hand(module), rel=1e-6)
    assert trainer.state.metrics["train_loss"] > 0 and "test_loss" in trainer.state.metrics


def test_a_list_of_batches_and_a_stream_are_loaders_too(tmp_path):
    x, y = dataset().tensors
    batches = [(x[i:i + 4], y[i:i + 4]) for i in range(0, N, 4)]

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(dataset())

    module, trainer = Regressor(), Trainer(project_dir=tmp_path)
    torch.testing.assert_close(trainer.predict(module, batches), forward_all(module))
    torch.testing.assert_close(trainer.predict(module, DataLoader(Stream(), batch_size=4)), forward_all(module))
    assert trainer.test(module, batches)["test_loss"] == pytest.approx(by_hand(module)["test_loss"], rel=1e-6)


class Structured(Regressor):
    def predict_step(self, batch):
        x, _ = batch
        return {"out": self(x), "pair": (x[:, 0], self(x) * 2)}


class Names(Regressor):
    def predict_step(self, batch):
        return [f"s{v:.3f}" for v in batch[0][:, 0].tolist()]


class Mixed(Regressor):
    def predict_step(self, batch):
        return {"out": self(batch[0]), "names": Names.predict_step(self, batch)}


def test_predict_joins_structured_outputs_leaf_by_leaf_and_lists_item_by_item(tmp_path):
    module, x = Structured(), dataset().tensors[0]
    predicted = Trainer(project_dir=tmp_path).predict(module, make_loader())
    torch.testing.assert_close(predicted["out"], forward_all(module))
    assert isinstance(predicted["pair"], tuple) and torch.equal(predicted["pair"][0], x[:, 0])
    torch.testing.assert_close(predicted["pair"][1], 2 * forward_all(module))
    names = Trainer(project_dir=tmp_path).predict(Names(), make_loader())
    assert names == [f"s{v:.3f}" for v in x[:, 0].tolist()]
    # Tensors and a list of strings in one dict: its samples could not be told apart on several processes.
    with pytest.raises(TypeError, match=r"predict_step must return .* Received: <dict> \(dict\)"):
        Trainer(project_dir=tmp_path).predict(Mixed(), make_loader())


def test_predict_step_defaults_to_forward(tmp_path):
    class Plain(TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(3, 2)

        def forward(self, x):
            return self.net(x)

    module = Plain()
    x = dataset().tensors[0]
    predicted = Trainer(project_dir=tmp_path).predict(module, DataLoader(x, batch_size=4))
    with torch.no_grad():
        torch.testing.assert_close(predicted, module(x))


def test_bf16_autocast_on_the_cpu_with_and_without_fit(tmp_path):
    module = Regressor()
    trainer = Trainer(accelerator=Accelerator(mixed_precision="bf16", cpu=True), project_dir=tmp_path / "a")
    predicted = trainer.predict(module, make_loader())
    assert predicted.dtype == torch.bfloat16 and all(module.autocast_seen)
    torch.testing.assert_close(predicted.float(), forward_all(module), atol=2e-2, rtol=2e-2)
    metrics = trainer.test(module, make_loader())
    assert metrics["test_loss"] == pytest.approx(by_hand(module)["test_loss"], rel=3e-2)

    fitted = Trainer(callbacks=[MixedPrecision("bf16")], project_dir=tmp_path / "b")
    fitted.fit(module, make_loader())
    module.autocast_seen.clear()
    predicted = fitted.predict(module, make_loader())
    assert predicted.dtype == torch.bfloat16 and module.autocast_seen and all(module.autocast_seen)
    torch.testing.assert_close(predicted.float(), forward_all(module), atol=2e-2, rtol=2e-2)


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.metrics_at_end: dict[str, float] = {}

    def on_test_start(self, trainer):
        self.events.append("on_test_start")

    def on_test_batch_end(self, trainer):
        self.events.append("on_test_batch_end")

    def on_test_end(self, trainer):
        self.events.append("on_test_end")
        self.metrics_at_end = dict(trainer.state.metrics)

    def on_predict_start(self, trainer):
        self.events.append("on_predict_start")

    def on_predict_batch_end(self, trainer):
        self.events.append("on_predict_batch_end")

    def on_predict_end(self, trainer):
        self.events.append("on_predict_end")

    def on_validation_start(self, trainer):
        self.events.append("on_validation_start")


def test_events_fire_in_order_and_test_end_sees_the_metrics(tmp_path):
    rec = Recorder()
    trainer = Trainer(callbacks=[rec], project_dir=tmp_path)
    metrics = trainer.test(Regressor(), make_loader())
    trainer.predict(trainer.module, make_loader())
    assert rec.events == (["on_test_start"] + ["on_test_batch_end"] * 3 + ["on_test_end"]
                          + ["on_predict_start"] + ["on_predict_batch_end"] * 3 + ["on_predict_end"])
    assert rec.metrics_at_end == pytest.approx(metrics)


def test_repeated_calls_prepare_each_loader_once(tmp_path):
    trainer, module, loader = Trainer(project_dir=tmp_path), Regressor(), make_loader()
    first = trainer.predict(module, loader)
    assert torch.equal(trainer.predict(module, loader), first)
    assert trainer.test(module, loader) == trainer.test(module, loader)
    assert len(trainer.accelerator.prepared.dataloaders) == 2  # one padded for predict, one not for test


@pytest.mark.parametrize("method", ["test", "predict"])
def test_a_missing_loader_is_refused_naming_the_method(tmp_path, method):
    with pytest.raises(TypeError, match=rf"Trainer\.{method}\(\): `loader` must be a DataLoader .*loader=None"):
        getattr(Trainer(project_dir=tmp_path), method)(Regressor(), None)
    with pytest.raises(TypeError, match=rf"Trainer\.{method}\(\) takes a TrainModule. Received: .*Linear"):
        getattr(Trainer(project_dir=tmp_path), method)(nn.Linear(3, 1), make_loader())


def test_a_module_without_the_steps_is_refused_naming_them(tmp_path):
    class TrainOnly(TrainModule):
        def training_step(self, batch):
            return batch.sum()

    with pytest.raises(TypeError, match="test_step.*validation_step.*TrainOnly implements neither"):
        Trainer(project_dir=tmp_path).test(TrainOnly(), make_loader())
    with pytest.raises(TypeError, match="predict_step.*TrainOnly implements neither predict_step nor forward"):
        Trainer(project_dir=tmp_path).predict(TrainOnly(), make_loader())


def test_bad_outputs_are_refused_naming_the_step(tmp_path):
    class Scalar(Regressor):
        def predict_step(self, batch):
            return self(batch[0]).sum()

    class Text(Regressor):
        def predict_step(self, batch):
            return "done"

    class Clash(Regressor):
        def test_step(self, batch):
            return {"val_acc": torch.tensor(1.0), "acc": torch.tensor(0.5)}

    class Vector(Regressor):
        def test_step(self, batch):
            return self(batch[0])

    trainer = Trainer(project_dir=tmp_path)
    with pytest.raises(ValueError, match="predict_step returned a 0-d tensor"):
        trainer.predict(Scalar(), make_loader())
    with pytest.raises(TypeError, match=r"predict_step must return .* Received: 'done' \(str\)"):
        Trainer(project_dir=tmp_path).predict(Text(), make_loader())
    with pytest.raises(ValueError, match="would record both metrics 'acc' and 'val_acc' as 'test_acc'"):
        Trainer(project_dir=tmp_path).test(Clash(), make_loader())
    expected = r"test_step must return a scalar or a dict of scalars. Received: Tensor\(4, 1\)"
    with pytest.raises(TypeError, match=expected):
        Trainer(project_dir=tmp_path).test(Vector(), make_loader())
