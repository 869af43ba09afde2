"""GradClip: the update is bounded, every element is bounded, `grad_norm` is the true pre-clip norm."""

from __future__ import annotations

import math

import pytest
import torch

from fittrain import Callback, Trainer
from fittrain.callbacks import GradClip, MixedPrecision


def _total_norm(trainer: Trainer) -> float:
    grads = [p.grad.detach().float().flatten() for p in trainer.model.parameters() if p.grad is not None]
    return torch.cat(grads).norm(2).item()


class PreClipProbe(Callback):
    """Listed before GradClip: sees the gradients as the optimizer would without clipping."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.max_abs: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer) -> None:
        trainer.accelerator.unscale_gradients()  # fp16: measure the true gradients, as GradClip does
        self.norms.append(_total_norm(trainer))
        self.max_abs.append(max(p.grad.abs().max().item() for p in trainer.model.parameters()))


class PostClipProbe(Callback):
    """Listed after GradClip: sees the clipped gradients, the recorded grad_norm and the update."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.max_abs: list[float] = []
        self.recorded: list[float] = []
        self.updates: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer) -> None:
        self.before = [p.detach().clone() for p in trainer.model.parameters()]
        self.max_abs.append(max(p.grad.abs().max().item() for p in trainer.model.parameters()))
        self.recorded.append(trainer.state.metrics["grad_norm"])

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.accelerator.sync_gradients:
            after = [p.detach() for p in trainer.model.parameters()]
            self.updates.append(torch.cat([(a - b).flatten() for a, b in zip(after, self.before)]).norm().item())


def _fit(make_module, make_loader, tmp_path, clip: GradClip, *extra: Callback, accumulation: int = 1):
    pre, post = PreClipProbe(), PostClipProbe()
    trainer = Trainer(project_dir=tmp_path, max_epochs=2, gradient_accumulation_steps=accumulation,
                      callbacks=[*extra, pre, clip, post])
    # lr=1 and targets scaled by 10: unclipped gradients (and updates) are orders of magnitude above the limits.
    trainer.fit(make_module(lr=1.0), make_loader(scale=10.0))
    return trainer, pre, post


@pytest.mark.parametrize("accumulation", [1, 2])
def test_max_norm_bounds_each_sgd_update(make_module, make_loader, tmp_path, accumulation):
    trainer, pre, post = _fit(make_module, make_loader, tmp_path, GradClip(max_norm=1e-3), accumulation=accumulation)
    assert len(post.updates) == trainer.state.global_step == 8 // accumulation
    assert min(pre.norms) > 1.0, "the test needs gradients far above the limit"
    # SGD with lr=1 moves the parameters by exactly the clipped gradient.
    assert max(post.updates) <= 1e-3 * (1 + 1e-5)
    assert min(post.updates) >= 1e-3 * 0.999, "clipping scales to the limit; it does not zero the update"


def test_grad_norm_is_recorded_before_clipping(make_module, make_loader, tmp_path):
    trainer, pre, post = _fit(make_module, make_loader, tmp_path, GradClip(max_norm=1e-3))
    assert post.recorded == pytest.approx(pre.norms, rel=1e-5)
    assert trainer.state.metrics["grad_norm"] == pytest.approx(pre.norms[-1], rel=1e-5)


def test_max_value_bounds_every_element(make_module, make_loader, tmp_path):
    _, pre, post = _fit(make_module, make_loader, tmp_path, GradClip(max_value=1e-2))
    assert min(pre.max_abs) > 1e-2, "the test needs elements above the limit"
    assert max(post.max_abs) <= 1e-2
    assert post.recorded == pytest.approx(pre.norms, rel=1e-5)


def test_inf_norm_type_records_the_largest_element(make_module, make_loader, tmp_path):
    _, pre, post = _fit(make_module, make_loader, tmp_path, GradClip(max_value=1e-2, norm_type=math.inf))
    assert post.recorded == pytest.approx(pre.max_abs, rel=1e-6)


def test_fp16_gradients_are_unscaled_before_clipping(make_module, make_loader, tmp_path):
    _, pre, post = _fit(make_module, make_loader, tmp_path, GradClip(max_norm=1e-3), MixedPrecision("fp16"))
    finite = [n for n in post.recorded if math.isfinite(n)]
    assert finite, "some fp16 steps must not overflow"
    # With the loss scale (65536) still in, the recorded norm would be about 1e4 times larger.
    assert finite == pytest.approx([n for n in pre.norms if math.isfinite(n)], rel=1e-3)
    assert max(finite) < 1e3
    assert max(post.updates) <= 1e-3 * (1 + 1e-3)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of `max_norm`"),
    ({"max_norm": 1.0, "max_value": 1.0}, "Received: max_norm=1.0, max_value=1.0"),
    ({"max_norm": 0}, "Received: max_norm=0"),
    ({"max_norm": -1.0}, "Received: max_norm=-1.0"),
    ({"max_value": "1"}, "Received: max_value='1'"),
    ({"max_norm": True}, "Received: max_norm=True"),
    ({"max_norm": 1.0, "norm_type": 0}, "Received: norm_type=0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        GradClip(**kwargs)
