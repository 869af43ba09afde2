"""Manual optimization (`automatic_optimization = False`): several optimizers stepped by
training_step, with Lightning's names, gradient accumulation, fp16, clipping and exact resume.
The 2-process runs (DDP, FSDP2) are in tests/trainer/test_manual_ddp.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fittrain import Accelerator, Callback, ProjectConfiguration, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip


class TwoParts(TrainModule):
    """Two linear parts with one optimizer each; `order` is the order the step is written in."""

    def __init__(self, order: str = "gan", optimizers: Any = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 1)
        self.order, self._optimizers = order, optimizers

    def losses(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        hidden = torch.tanh(self.a(x))
        return (self.b(hidden.detach()) - y).pow(2).mean(), (self.b(hidden) - y).pow(2).mean()

    def training_step(self, batch: Any) -> torch.Tensor:
        opt_a, opt_b = self.optimizers()
        loss_b, loss_a = self.losses(batch)
        if self.order == "gan":  # zero_grad, backward, step: one optimizer after the other
            # a's loss sees b as it was before b's step (a copy, since the step changes b in place).
            x, y = batch
            frozen_b = [p.detach().clone() for p in self.b.parameters()]
            loss_a = (nn.functional.linear(torch.tanh(self.a(x)), *frozen_b) - y).pow(2).mean()
            opt_b.zero_grad()
            self.manual_backward(loss_b)
            opt_b.step()
            opt_a.zero_grad()
            self.manual_backward(loss_a)
            opt_a.step()
        else:  # both backwards, then both steps, then zero_grad (Accelerate's order)
            self.manual_backward(loss_b, inputs=list(self.b.parameters()))
            self.manual_backward(loss_a, inputs=list(self.a.parameters()))
            opt_b.step()
            opt_a.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
        schedulers = self.lr_schedulers()
        for scheduler in schedulers if isinstance(schedulers, list) else [schedulers] if schedulers else []:
            scheduler.step()
        return loss_a

    def configure_optimizers(self) -> Any:
        if self._optimizers is not None:
            return self._optimizers(self)
        opt_a = torch.optim.SGD(self.a.parameters(), lr=0.1, momentum=0.9)
        opt_b = torch.optim.Adam(self.b.parameters(), lr=0.01)
        return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)]


def batches(n: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * size, 3, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n * size, size)]


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(tmp_path, data, module: TrainModule | None = None, **kwargs: Any) -> tuple[Trainer, TrainModule]:
    torch.manual_seed(0)
    module = module or TwoParts()
    trainer = Trainer(project_dir=tmp_path, **kwargs)
    trainer.fit(module, data)
    return trainer, module


# ----------------------------------------------------------------- what configure_optimizers may return
@pytest.mark.parametrize("form", ["list", "lists", "dicts", "tuple"])
def test_lightning_forms_give_every_optimizer_and_scheduler(form: str, tmp_path) -> None:
    def configure(module: TwoParts) -> Any:
        opt_a, opt_b = torch.optim.SGD(module.a.parameters(), lr=0.1), torch.optim.SGD(module.b.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1)
        return {"list": [opt_a, opt_b], "lists": ([opt_a, opt_b], [sched]),
                "dicts": ({"optimizer": opt_a}, {"optimizer": opt_b, "lr_scheduler": {"scheduler": sched}}),
                "tuple": (opt_a, opt_b)}[form]

    trainer, module = fit(tmp_path, batches(2, 4), TwoParts(optimizers=configure), max_steps=1)
    assert [o.optimizer.param_groups[0]["params"][0] is p for o, p in zip(trainer.optimizers,
                                                                         (module.a.weight, module.b.weight))]
    assert len(trainer.optimizers) == 2 and len(trainer.schedulers) == (0 if form in ("list", "tuple") else 1)
    assert trainer.optimizer is trainer.optimizers[0]  # outside a step: the first one


def test_one_optimizer_is_returned_alone_and_no_scheduler_is_none(tmp_path) -> None:
    seen = {}

    class One(TwoParts):
        def training_step(self, batch: Any) -> None:
            seen["optimizers"], seen["schedulers"] = self.optimizers(), self.lr_schedulers()
            self.manual_backward(self.losses(batch)[1])
            seen["optimizers"].step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer, _ = fit(tmp_path, batches(2, 4), One(), max_steps=2)
    assert seen["optimizers"] is trainer.optimizers[0] and seen["schedulers"] is None
    assert trainer.state.global_step == 2 and "train_loss" not in trainer.state.metrics  # None returned: fine


@pytest.mark.parametrize("returned, message", [
    (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.b.parameters(), lr=0.1)],
     r"optimizers 0 \(SGD\) and 1 \(SGD\) that both hold the parameter 'b.weight'"),
    (lambda m: [torch.optim.SGD(m.a.parameters(), lr=0.1), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)],
     r"not parameters of TwoParts"),
    (lambda m: {"optimizer": torch.optim.SGD(m.parameters(), lr=0.1), "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.parameters(), lr=0.1), 1), "interval": "step"}},
     r"'interval' in an lr_scheduler dict .* has no effect in manual optimization.*call sch.step\(\)"),
    (lambda m: [torch.optim.SGD(m.a.parameters(), lr=0.1), "adam"], r"must return an optimizer, a list of"),
    (lambda m: ([torch.optim.SGD(m.a.parameters(), lr=0.1)],
                [torch.optim.lr_scheduler.StepLR(torch.optim.SGD(m.b.parameters(), lr=0.1), 1)]),
     r"built on an optimizer that configure_optimizers did not return"),
])
def test_bad_returns_are_refused_naming_what_was_received(returned: Any, message: str, tmp_path) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        fit(tmp_path, batches(1, 4), TwoParts(optimizers=returned))


def test_automatic_mode_refuses_two_optimizers_and_points_to_manual(tmp_path) -> None:
    module = TwoParts()
    module.automatic_optimization = True
    with pytest.raises(ValueError, match=r"2 optimizers.*self.automatic_optimization = False"):
        fit(tmp_path, batches(1, 4), module)


def test_automatic_optimization_must_be_a_bool(tmp_path) -> None:
    module = TwoParts()
    module.automatic_optimization = "no"
    with pytest.raises(TypeError, match=r"automatic_optimization` must be True or False. Received: .*'no'"):
        fit(tmp_path, batches(1, 4), module)


def test_the_methods_explain_when_they_cannot_be_called(tmp_path) -> None:
    with pytest.raises(RuntimeError, match=r"TwoParts.optimizers\(\) needs a running Trainer.fit"):
        TwoParts().optimizers()

    class Automatic(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch: Any) -> torch.Tensor:
            loss = self.net(batch[0]).pow(2).mean()
            self.manual_backward(loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match=r"manual_backward\(loss\) is for manual optimization.*"
                                           r"self.automatic_optimization = False"):
        Trainer(project_dir=tmp_path).fit(Automatic(), batches(1, 4))


# ----------------------------------------------------------------- accumulation, events, clipping
@pytest.mark.parametrize("order", ["gan", "accelerate"])
def test_accumulation_needs_no_code_and_equals_the_larger_batch(order: str, tmp_path) -> None:
    data = batches(8, 4)
    merged = [tuple(torch.cat(parts) for parts in zip(data[i], data[i + 1])) for i in range(0, 8, 2)]
    torch.manual_seed(0)
    accumulated, module = fit(tmp_path / "acc", data, TwoParts(order), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    _, reference = fit(tmp_path / "ref", merged, TwoParts(order))
    assert accumulated.state.global_step == 4  # accumulation windows, not opt.step() calls
    for key, value in weights(reference).items():
        torch.testing.assert_close(weights(module)[key], value, rtol=0, atol=1e-6)
    assert accumulated.schedulers[0].get_last_lr() == [0.1 * 0.5 ** 2]  # stepped after real steps only


class Recorder(Callback):
    def on_fit_start(self, trainer: Trainer) -> None:
        self.events: list[Any] = []

    def on_before_backward(self, trainer: Trainer) -> None:
        self.events.append("backward")

    def on_after_backward(self, trainer: Trainer) -> None:
        self.events.append("after_backward")

    def on_before_optimizer_step(self, trainer: Trainer) -> None:
        grads = {name: p.grad is not None for name, p in trainer.module.named_parameters()}
        self.events.append((trainer.optimizers.index(trainer.optimizer), grads))


def test_events_fire_around_each_backward_and_real_step_with_the_stepping_optimizer(tmp_path) -> None:
    recorder = Recorder()
    trainer, _ = fit(tmp_path, batches(2, 4), TwoParts("gan"), callbacks=[recorder], gradient_accumulation_steps=2)
    first_window = ["backward", "after_backward"] * 2
    assert recorder.events[:4] == first_window  # no step event inside the window
    steps = [e for e in recorder.events[4:] if isinstance(e, tuple)]
    assert [index for index, _ in steps] == [1, 0]  # opt_b, then opt_a
    assert trainer.optimizer is trainer.optimizers[0]


def test_grad_clip_clips_only_the_stepping_optimizers_gradients(tmp_path) -> None:
    norms: list[tuple[int, float, float]] = []

    class Norms(Callback):
        def on_before_optimizer_step(self, trainer: Trainer) -> None:
            module = trainer.module
            norms.append((trainer.optimizers.index(trainer.optimizer),
                          float(torch.cat([p.grad.flatten() for p in module.a.parameters()]).norm()),
                          float(torch.cat([p.grad.flatten() for p in module.b.parameters()]).norm())))

    # In "accelerate" order both optimizers have gradients when the first one steps.
    fit(tmp_path, batches(1, 4), TwoParts("accelerate"), callbacks=[GradClip(max_norm=1e-3), Norms()])
    (first, a_at_b, b_at_b), (second, a_at_a, b_at_a) = norms
    assert (first, second) == (1, 0)
    assert b_at_b == pytest.approx(1e-3, rel=1e-3) and a_at_b > 1e-2  # b's step clipped b's gradients only
    assert a_at_a == pytest.approx(1e-3, rel=1e-3)


def test_clip_gradients_is_lightnings_method(tmp_path) -> None:
    seen = []

    class Clipping(TwoParts):
        def training_step(self, batch: Any) -> None:
            opt_a, opt_b = self.optimizers()
            self.manual_backward(self.losses(batch)[1])
            self.clip_gradients(opt_a, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
            seen.append(max(p.grad.abs().max().item() for p in self.a.parameters()))
            opt_a.step()
            with pytest.raises(ValueError, match=r"gradient_clip_algorithm=.*Received: gradient_clip_algorithm='l2'"):
                self.clip_gradients(opt_a, 1.0, "l2")

    fit(tmp_path, batches(1, 4), Clipping())
    assert seen == [pytest.approx(1e-3)]


# ----------------------------------------------------------------- fp16: one scaler, several optimizers
def _fp16_pair(order: str) -> tuple[Accelerator, nn.Module, Any, Any]:
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    opt_0 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_1 = torch.optim.SGD(model[1].parameters(), lr=0.1)
    return (accelerator, *accelerator.prepare(model, opt_0, opt_1))


@pytest.mark.parametrize("order", ["both_then_both", "gan"])
def test_fp16_overflow_in_one_optimizer_skips_exactly_its_step_and_updates_the_scale_once(order: str) -> None:
    accelerator, model, opt_0, opt_1 = _fp16_pair(order)
    scaler = accelerator.precision.scaler
    x = torch.randn(4, 3)
    scale = scaler.get_scale()
    before = [p.detach().clone() for p in model.parameters()]
    hidden = model[0](x)
    loss_1, loss_0 = model[1](hidden.detach()).pow(2).mean(), model[1](hidden).pow(2).mean()
    true_1 = torch.autograd.grad(loss_1, list(model[1].parameters()), retain_graph=True)
    if order == "both_then_both":
        accelerator.backward(loss_1, inputs=list(model[1].parameters()))
        accelerator.backward(loss_0, inputs=list(model[0].parameters()))
        model[0].weight.grad[0, 0] = float("inf")
        opt_0.step()
        opt_1.step()  # with an update in between, this would unscale by the wrong (halved) scale
    else:
        accelerator.backward(loss_0, inputs=list(model[0].parameters()))
        model[0].weight.grad[0, 0] = float("inf")
        opt_0.step()
        accelerator.backward(loss_1, inputs=list(model[1].parameters()))
        opt_1.step()
    assert (opt_0.step_was_skipped, opt_1.step_was_skipped) == (True, False)
    assert accelerator.optimizer_step_was_skipped is True  # any optimizer, as in Accelerate
    after = [p.detach() for p in model.parameters()]
    assert torch.equal(after[0], before[0])
    # opt_1 stepped on its true gradient: unscaled by the scale its backward used, not a halved one.
    for p, b, g in zip(after[2:], before[2:], true_1):
        torch.testing.assert_close(p, b - 0.1 * g.float(), rtol=1e-3, atol=1e-5)
    assert accelerator.precision.state_dict()["scale"] == scale / 2  # one update, after both steps
    assert scaler.get_scale() == scale / 2


def test_fp16_two_optimizers_step_with_the_true_gradients() -> None:
    accelerator, model, opt_0, opt_1 = _fp16_pair("both_then_both")
    x = torch.randn(4, 3)
    hidden = model[0](x)
    loss = model[1](hidden).pow(2).mean()
    reference = [g.float() for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)]
    before = [p.detach().clone() for p in model.parameters()]
    accelerator.backward(loss)
    opt_1.step()
    opt_0.step()
    for p, b, g in zip(model.parameters(), before, reference):
        torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------- checkpoints and exact resume
@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_a_resumed_manual_run_ends_bit_identical_to_an_uninterrupted_one(precision: str, tmp_path) -> None:
    def run(project: str, resume_from: Any = None) -> tuple[Trainer, TrainModule]:
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, mixed_precision=precision, gradient_accumulation_steps=2,
                                  project_config=ProjectConfiguration(tmp_path / project,
                                                                      automatic_checkpoint_naming=True))
        trainer = Trainer(max_steps=5, accelerator=accelerator, resume_from=resume_from,
                          callbacks=[Checkpointer(every_n_steps=2), GradClip(max_norm=0.5)])
        module = TwoParts("gan")
        trainer.fit(module, batches(6, 4))
        return trainer, module

    whole, whole_module = run("whole")
    folder = tmp_path / "whole" / "checkpoints" / whole.run_name / "checkpoint_0"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(("optimizer", "scheduler"))) == [
        "optimizer.pt", "optimizer_1.pt", "scheduler.pt"]  # every optimizer and scheduler
    resumed, resumed_module = run("resumed", resume_from=folder)
    assert resumed.state.global_step == whole.state.global_step == 5
    for key, value in weights(whole_module).items():
        assert torch.equal(weights(resumed_module)[key], value), key
    for a, b in zip(whole.optimizers, resumed.optimizers):
        assert str(a.state_dict()) == str(b.state_dict())
    assert resumed.schedulers[0].get_last_lr() == whole.schedulers[0].get_last_lr()
    assert resumed.accelerator.precision.state_dict() == whole.accelerator.precision.state_dict()
