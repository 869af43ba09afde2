"""Mixed precision (fittrain/step/precision.py) through the Accelerator: "no", "bf16" and "fp16" on CPU.

fp16 works on a CPU-only machine: torch autocasts to float16 there and its GradScaler runs on
"cpu". Gradients are checked against values computed by hand from the scaler's own scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fittrain import Accelerator
from fittrain.step.precision import AutocastForward, FullPrecision, ScaledPrecision, to_fp32
from support.models import mlp


def record_linear_output_dtypes(model: nn.Module) -> list[torch.dtype]:
    """Collects the dtype of every Linear's output during forward passes."""
    dtypes: list[torch.dtype] = []
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    return dtypes


def inputs(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(1))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def total_norm(tensors: list[torch.Tensor]) -> float:
    return torch.stack([t.float().norm() for t in tensors]).norm().item()


# ------------------------------------------------------------------ "no"
def test_no_precision_changes_nothing():
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    assert accelerator.mixed_precision == "no" and type(accelerator.precision) is FullPrecision
    reference = mlp()
    model = accelerator.prepare(mlp())
    # The forward is not wrapped at all, so "no" costs nothing per call.
    assert "forward" not in model.__dict__
    dtypes = record_linear_output_dtypes(model)
    assert torch.equal(model(inputs()), reference(inputs()))
    assert dtypes == [torch.float32, torch.float32]
    with accelerator.autocast():
        assert (inputs() @ inputs().T).dtype == torch.float32
    loss = model(inputs()).pow(2).mean()
    assert accelerator.precision.scale_loss(loss) is loss
    # backward is a plain backward: the same gradients as PyTorch's.
    accelerator.backward(loss)
    reference(inputs()).pow(2).mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(reference)))


def test_none_means_no():
    assert Accelerator(cpu=True, mixed_precision=None).mixed_precision == "no"


# ------------------------------------------------------------------ bf16
def test_bf16_runs_the_forward_in_bf16_and_returns_fp32():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    reference = mlp()
    model = accelerator.prepare(mlp())
    dtypes = record_linear_output_dtypes(model)
    out = model(inputs())
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # inside: bf16
    assert out.dtype == torch.float32  # outside: fp32
    # The values are the bf16 computation's, close to but not equal to fp32's.
    want = reference(inputs())
    torch.testing.assert_close(out, want, atol=5e-2, rtol=5e-2)
    assert not torch.equal(out, want)
    # Gradients flow back to the fp32 parameters.
    accelerator.backward(out.pow(2).mean())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_bf16_converts_nested_floating_outputs_only():
    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor):
            y = self.linear(x)
            return {"y": y, "parts": (y, [y.argmax(dim=1)]), "name": "out"}

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    out = accelerator.prepare(Multi())(inputs())
    assert out["y"].dtype == torch.float32 and out["parts"][0].dtype == torch.float32
    assert out["parts"][1][0].dtype == torch.int64  # integers are left alone
    assert out["name"] == "out"


def test_autocast_context_for_code_outside_the_model():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with accelerator.autocast():
        assert (inputs() @ inputs().T).dtype == torch.bfloat16
    assert (inputs() @ inputs().T).dtype == torch.float32


def test_to_fp32_converts_half_types_recursively():
    half = torch.ones(2, dtype=torch.float16)
    out = to_fp32({"a": [half, (half.bfloat16(), 1)], "b": torch.ones(2, dtype=torch.float64)})
    assert out["a"][0].dtype == torch.float32 and out["a"][1][0].dtype == torch.float32
    assert out["a"][1][1] == 1 and out["b"].dtype == torch.float64


# ------------------------------------------------------------------ fp16 with a GradScaler
def fp16_setup(**kwargs):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", **kwargs)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def test_fp16_on_cpu_autocasts_and_scales_the_loss():
    accelerator, model, optimizer, _ = fp16_setup()
    assert isinstance(accelerator.precision, ScaledPrecision)
    scaler = accelerator.precision.scaler
    assert scaler.is_enabled()
    dtypes = record_linear_output_dtypes(model)
    out = model(inputs())
    assert dtypes == [torch.float16, torch.float16] and out.dtype == torch.float32

    # Reference gradients: the same fp16 forward, plain backward, no scaling.
    reference = copy.deepcopy(accelerator.unwrap_model(model, keep_fp32_wrapper=True))
    reference(inputs()).pow(2).mean().backward()
    accelerator.backward(out.pow(2).mean())
    scale = scaler.get_scale()
    assert scale > 1
    for got, want in zip(grads(model), grads(reference)):
        torch.testing.assert_close(got / scale, want, rtol=1e-3, atol=1e-6)

    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped
    # The step used unscaled gradients: p - lr * grad, not p - lr * scale * grad.
    for p, b, g in zip(model.parameters(), before, grads(reference)):
        torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=1e-3, atol=1e-5)


def test_fp16_training_reduces_the_loss():
    accelerator, model, optimizer, _ = fp16_setup()
    x = inputs(32)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_inf_gradient_skips_the_step_and_the_prepared_scheduler():
    accelerator, model, optimizer, scheduler = fp16_setup()
    scaler = accelerator.precision.scaler

    optimizer.zero_grad()
    accelerator.backward(model(inputs()).pow(2).mean())
    next(model.parameters()).grad[0, 0] = float("inf")  # an overflow, as fp16 produces
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped is True
    assert optimizer.step_was_skipped is True
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == scale / 2  # the scaler backed off
    assert scheduler.get_last_lr() == [0.1]  # the schedule did not advance for a skipped step
    assert scheduler.scheduler.last_epoch == 0

    # The next, finite step happens, and the schedule advances with it.
    optimizer.zero_grad()
    accelerator.backward(model(inputs()).pow(2).mean())
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped is False
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert scheduler.get_last_lr() == [pytest.approx(0.05)]


def test_clip_grad_norm_unscales_once_per_step():
    accelerator, model, optimizer, _ = fp16_setup()
    scaler = accelerator.precision.scaler
    for _ in range(2):  # the second step must unscale again: once per step, not once ever
        optimizer.zero_grad()
        accelerator.backward(model(inputs()).pow(2).mean())
        expected = total_norm([g / scaler.get_scale() for g in grads(model)])
        first = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6)
        assert float(first) == pytest.approx(expected, rel=1e-4)
        # A second clip in the same step sees the already-unscaled gradients, not scale**-2 of them.
        second = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e6)
        assert float(second) == pytest.approx(expected, rel=1e-4)
        unscaled = grads(model)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()  # and the step does not unscale a third time
        for p, b, g in zip(model.parameters(), before, unscaled):
            torch.testing.assert_close(p.detach(), b - 0.1 * g, rtol=1e-4, atol=1e-6)


def test_clip_grad_norm_clips_the_unscaled_gradients():
    accelerator, model, optimizer, _ = fp16_setup()
    optimizer.zero_grad()
    accelerator.backward(model(inputs()).pow(2).mean())
    unscaled = total_norm(grads(model)) / accelerator.precision.scaler.get_scale()
    limit = unscaled / 4
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=limit)
    assert float(norm) == pytest.approx(unscaled, rel=1e-4)
    assert total_norm(grads(model)) == pytest.approx(limit, rel=1e-3)


def test_clip_grad_value_unscales_first():
    accelerator, model, optimizer, _ = fp16_setup()
    optimizer.zero_grad()
    accelerator.backward(model(inputs()).pow(2).mean())
    unscaled_max = max(g.abs().max().item() for g in grads(model)) / accelerator.precision.scaler.get_scale()
    limit = unscaled_max / 2
    accelerator.clip_grad_value_(model.parameters(), limit)
    got = max(g.abs().max().item() for g in grads(model))
    assert got == pytest.approx(limit, rel=1e-5)  # clipped at the limit, in unscaled units


def test_scaler_state_round_trips():
    accelerator, model, optimizer, _ = fp16_setup()
    optimizer.zero_grad()
    accelerator.backward(model(inputs()).pow(2).mean())
    next(model.parameters()).grad[0, 0] = float("nan")
    optimizer.step()
    state = accelerator.precision.state_dict()
    other = Accelerator(cpu=True, mixed_precision="fp16")
    other.precision.load_state_dict(state)
    assert other.precision.scaler.get_scale() == accelerator.precision.scaler.get_scale() != 65536.0


def test_mixed_precision_can_be_set_before_prepare_only():
    accelerator = Accelerator(cpu=True)
    accelerator.mixed_precision = "bf16"
    model = accelerator.prepare(mlp())
    assert isinstance(model.__dict__["forward"], AutocastForward)
    with pytest.raises(RuntimeError, match="before prepare"):
        accelerator.mixed_precision = "fp16"


@pytest.mark.parametrize("value", ["fp7", "FP16", "bfloat16", 16, ""])
def test_unknown_precision_names_the_argument_and_value(value):
    with pytest.raises(ValueError) as info:
        Accelerator(cpu=True, mixed_precision=value)
    assert "mixed_precision" in str(info.value) and repr(value) in str(info.value)


# ------------------------------------------------------------------ closures
def lbfgs_run(accelerator: Accelerator) -> list[torch.Tensor]:
    """Three LBFGS steps (which need a closure) on a fixed regression problem."""
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = inputs()
    y = x.sum(1, keepdim=True)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        return loss

    for _ in range(3):
        optimizer.step(closure)
    return [p.detach().clone() for p in model.parameters()]


def test_closure_step_matches_plain_lbfgs_without_fp16():
    model = mlp()
    plain = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x = inputs()
    y = x.sum(1, keepdim=True)

    def closure() -> torch.Tensor:
        plain.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        plain.step(closure)
    for mode in ("no", "bf16"):
        got = lbfgs_run(Accelerator(cpu=True, mixed_precision=mode))
        expected = [p.detach() for p in model.parameters()]
        if mode == "no":
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        else:  # the forward runs in bf16: close, not equal
            assert all(torch.allclose(a, b, atol=0.1) for a, b in zip(got, expected))


def test_closure_step_under_fp16_is_refused_with_the_fix():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"optimizer.step\(closure\) is not supported with mixed_precision='fp16'"
                       r".*Received: closure=.*use bf16 or full precision"):
        lbfgs_run(accelerator)
