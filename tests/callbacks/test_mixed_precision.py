"""MixedPrecision: layers inside training_step compute in bf16/fp16; fp16 brings a GradScaler."""

from __future__ import annotations

import pytest
import torch

from fittrain import Accelerator, Trainer
from fittrain.callbacks import Checkpointer, MixedPrecision
from fittrain.checkpoint.run_folders import run_folder


def _fit_and_watch(module, loader, tmp_path, *callbacks, accelerator=None):
    """Fits with a forward hook on the first inner Linear; returns the trainer and the dtypes it saw."""
    seen: dict[str, set[torch.dtype]] = {"train": set(), "val": set()}
    inner = module.net[0]
    inner.register_forward_hook(lambda mod, args, out: seen["train" if mod.training else "val"].add(out.dtype))
    trainer = Trainer(project_dir=tmp_path, max_epochs=1, accelerator=accelerator, callbacks=list(callbacks))
    trainer.fit(module, loader, loader)
    return trainer, seen


def test_bf16_makes_layers_inside_training_step_produce_bf16(make_module, make_loader, tmp_path):
    module = make_module()
    trainer, seen = _fit_and_watch(module, make_loader(), tmp_path, MixedPrecision("bf16"))
    assert seen == {"train": {torch.bfloat16}, "val": {torch.bfloat16}}
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(p.dtype == torch.float32 for p in module.parameters()), "weights stay fp32; only compute is bf16"
    assert torch.isfinite(trainer.state.loss)


def test_fp16_runs_on_cpu_with_a_grad_scaler(make_module, make_loader, tmp_path):
    module = make_module()
    trainer, seen = _fit_and_watch(module, make_loader(), tmp_path, MixedPrecision("fp16"),
                                   Checkpointer(every_n_epochs=1))
    assert seen["train"] == {torch.float16}
    assert isinstance(getattr(trainer.accelerator.precision, "scaler", None), torch.amp.GradScaler)
    checkpoint = run_folder(tmp_path) / "checkpoint_0"
    scaler_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert scaler_state["scale"] > 0


def test_no_keeps_fp32_and_saves_no_scaler(make_module, make_loader, tmp_path):
    trainer, seen = _fit_and_watch(make_module(), make_loader(), tmp_path, MixedPrecision("no"),
                                   Checkpointer(every_n_epochs=1))
    assert seen == {"train": {torch.float32}, "val": {torch.float32}}
    assert not (run_folder(tmp_path) / "checkpoint_0" / "scaler.pt").exists()


def test_overrides_a_user_accelerator_before_prepare(make_module, make_loader, tmp_path):
    accelerator = Accelerator(mixed_precision="no")
    trainer, seen = _fit_and_watch(make_module(), make_loader(), tmp_path, MixedPrecision("bf16"),
                                   accelerator=accelerator)
    assert trainer.accelerator is accelerator and accelerator.mixed_precision == "bf16"
    assert seen["train"] == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["fp7", "FP16", None, 16])
def test_bad_precision(precision):
    with pytest.raises(ValueError, match=r"`MixedPrecision\(precision=...\)` must be one of 'no', 'fp16' or 'bf16'"
                                         rf"\. Received: precision={precision!r}\."):
        MixedPrecision(precision)
