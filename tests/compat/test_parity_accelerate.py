"""Parity with Hugging Face Accelerate: one training script, two Accelerators, the same result.

The script in ``run`` is written once against Accelerate's API and run with ``accelerate.Accelerator``
and with ``fittrain.Accelerator``. Both runs must end with the same parameters and the same
learning-rate sequence. Skipped when accelerate is not installed (it is only a benchmark extra).

Semantics this pins down, on one process, as Accelerate has them:
- Under ``accumulate``, a window closes every ``gradient_accumulation_steps`` batches and also on the
  last batch of the dataloader, so 15 batches with 4 steps give windows of 4, 4, 4 and 3, and the
  counting starts afresh each epoch.
- ``backward`` divides the loss by ``gradient_accumulation_steps``, the short last window included.
- The prepared scheduler steps only when the optimizer really stepped (a sync step that was not
  skipped), so its learning rate is constant inside a window.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import fittrain  # noqa: E402

N_SAMPLES, BATCH_SIZE, EPOCHS = 60, 4, 2  # 15 batches an epoch: not a multiple of 4
BATCHES = N_SAMPLES // BATCH_SIZE
LR = 0.05

CASES = {
    "plain": dict(accumulation=1, precision="no", clip=None, use_accumulate=False),
    "accumulate4": dict(accumulation=4, precision="no", clip=None, use_accumulate=True),
    "clip_norm": dict(accumulation=1, precision="no", clip=0.5, use_accumulate=True),
    "bf16_accumulate2": dict(accumulation=2, precision="bf16", clip=None, use_accumulate=True),
}

FP32_ATOL = 1e-5
# bf16 keeps ~3 significant digits. Two correct implementations may place the autocast boundary a
# little differently (which ops see bf16 inputs, where outputs are cast back to fp32), and such
# rounding differences compound over the steps, so bf16 runs agree to ~1e-3, not to fp32 precision.
BF16_ATOL = 1e-3


def _reset_accelerate_singletons() -> None:
    # Accelerate keeps process-global state (AcceleratorState, GradientState); a second Accelerator
    # with other settings in the same process would inherit or reject it. fittrain has none.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _build(case: str):
    torch.manual_seed(1234)
    x = torch.randn(N_SAMPLES, 4)
    w = torch.randn(4, 1)
    scale = 20.0 if CASES[case]["clip"] else 1.0  # large targets make the clip act
    y = (x @ w + 0.3) * scale
    # shuffle=False: Accelerate's shuffled order differs from a plain DataLoader's by design.
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=False)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
    return model, optimizer, loader, scheduler


def run(Accelerator_cls, case: str, record: dict | None = None):
    """Train with ``Accelerator_cls`` and return (final parameters, lr after each scheduler.step())."""
    cfg = CASES[case]
    _reset_accelerate_singletons()
    try:
        model, optimizer, loader, scheduler = _build(case)
        accelerator = Accelerator_cls(
            cpu=True,
            mixed_precision=cfg["precision"],
            gradient_accumulation_steps=cfg["accumulation"],
        )
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        loss_function = nn.MSELoss()
        lrs, norms, syncs, first_outputs = [], [], [], None
        for _ in range(EPOCHS):
            for inputs, targets in loader:
                window = accelerator.accumulate(model) if cfg["use_accumulate"] else nullcontext()
                with window:
                    outputs = model(inputs)
                    if first_outputs is None:
                        first_outputs = outputs.detach().float().cpu().clone()
                    with accelerator.autocast():
                        loss = loss_function(outputs, targets)
                    accelerator.backward(loss)
                    syncs.append(bool(accelerator.sync_gradients))
                    if cfg["clip"] is not None and accelerator.sync_gradients:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), cfg["clip"])))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                lrs.append(scheduler.get_last_lr()[0])
        params = [p.detach().float().cpu().clone() for p in accelerator.unwrap_model(model).parameters()]
    finally:
        _reset_accelerate_singletons()
    if record is not None:
        record.update(norms=norms, syncs=syncs, first_outputs=first_outputs)
    return params, lrs


def _expected_syncs(accumulation: int) -> list[bool]:
    one_epoch = [(i % accumulation == 0) or (i == BATCHES) for i in range(1, BATCHES + 1)]
    return one_epoch * EPOCHS


def _expected_lrs(accumulation: int) -> list[float]:
    lrs, steps = [], 0
    for sync in _expected_syncs(accumulation):
        steps += sync
        lrs.append(LR * 0.9**steps)
    return lrs


@pytest.mark.parametrize("case", list(CASES))
def test_same_parameters_and_lr_sequence_as_accelerate(case: str) -> None:
    cfg = CASES[case]
    acc_record, fit_record = {}, {}
    acc_params, acc_lrs = run(accelerate.Accelerator, case, acc_record)
    fit_params, fit_lrs = run(fittrain.Accelerator, case, fit_record)
    atol = BF16_ATOL if cfg["precision"] == "bf16" else FP32_ATOL

    # The script itself is sound: Accelerate behaves as the module docstring says, and training
    # moves the parameters far more than the tolerance, so agreement is meaningful.
    initial = [p.detach().clone() for p in _build(case)[0].parameters()]
    assert acc_record["syncs"] == _expected_syncs(cfg["accumulation"])
    assert acc_lrs == pytest.approx(_expected_lrs(cfg["accumulation"]))
    assert max((a - b).abs().max().item() for a, b in zip(acc_params, initial)) > 20 * atol

    assert fit_record["syncs"] == acc_record["syncs"]
    assert fit_lrs == pytest.approx(acc_lrs, rel=1e-9, abs=1e-12)
    assert len(fit_params) == len(acc_params)
    for i, (got, want) in enumerate(zip(fit_params, acc_params)):
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=atol), f"parameter {i}: max abs diff {diff:.3g} > {atol}"

    if cfg["precision"] == "bf16":
        # The final-parameter tolerance is too loose to tell bf16 from fp32 training on a model this
        # small, so check the forward itself: after prepare(), Accelerate runs the model under
        # autocast, and its first outputs differ from an fp32 forward. fittrain's must match
        # Accelerate's, not the fp32 ones.
        model, _, loader, _ = _build(case)
        with torch.no_grad():
            fp32_outputs = model(next(iter(loader))[0])
        bf16_error = (acc_record["first_outputs"] - fp32_outputs).abs().max().item()
        assert bf16_error > 0
        diff = (fit_record["first_outputs"] - acc_record["first_outputs"]).abs().max().item()
        assert diff < 0.1 * bf16_error, (
            f"first forward after prepare(): fittrain differs from Accelerate by {diff:.3g}, "
            f"while bf16 vs fp32 differ by {bf16_error:.3g}; is the prepared forward autocast?"
        )

    if cfg["clip"] is not None:
        assert max(acc_record["norms"]) > cfg["clip"]  # the clip really acted
        assert fit_record["norms"] == pytest.approx(acc_record["norms"], rel=1e-5)
