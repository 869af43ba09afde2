"""On a CUDA device: placement, fp16 with a GradScaler, bf16 autocast, and exact resume with the CUDA RNG.

CI has no GPU, so every test here skips without one. The rest of the suite hides CUDA (tests/conftest.py);
on a GPU machine run these with `FITTRAIN_TEST_CUDA=1 python -m pytest -q tests/gpu`.
The CPU suite covers the same paths on "cpu" (tests/step/test_precision.py, tests/resume/); these
check what only CUDA has: the device a prepared object lands on, the CUDA GradScaler, the CUDA
RNG's state in checkpoints, and checkpoints written from GPU tensors.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, GradScalerKwargs, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip, MixedPrecision
from fittrain.checkpoint.run_folders import run_folder
from gpu_support import needs_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = needs_cuda


def _net() -> nn.Module:
    # Dropout draws from the CUDA generator on every training step: a resume that did not restore
    # it would drop other units and end with other weights.
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 1))


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


class Regression(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_prepare_places_model_optimizer_state_and_batches_on_the_gpu():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _loader())
    assert accelerator.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in model.parameters())
    x, y = next(iter(loader))
    assert x.device.type == y.device.type == "cuda"
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    assert all(s.device.type == "cuda" for state in optimizer.state.values() for s in state.values()
               if isinstance(s, torch.Tensor) and s.dim() > 0)


def test_fp16_uses_a_cuda_grad_scaler_that_skips_an_overflowed_step():
    accelerator = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = accelerator.precision.scaler
    assert scaler._device == "cuda"  # private, but the one record of where the scaler runs
    inner = []
    model[0].register_forward_hook(lambda mod, args, out: inner.append(out.dtype))
    x = torch.randn(8, 16, device="cuda")
    out = model(x)
    assert inner == [torch.float16] and out.dtype == torch.float32  # fp16 inside, fp32 handed back

    accelerator.backward(out.pow(2).mean())
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    optimizer.step()
    assert accelerator.optimizer_step_was_skipped is True
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == scale / 2

    optimizer.zero_grad()
    accelerator.backward(model(x).pow(2).mean())
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert torch.isfinite(norm) and norm.device.type == "cuda"
    optimizer.step()
    assert accelerator.optimizer_step_was_skipped is False
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_an_fp16_step_reads_nothing_from_the_gpu_after_the_optimizer_update():
    # A read after the update (the scale, say) waits for the update's kernels, so the GPU idles until
    # the next forward is queued: in benchmarks.gpu such reads cost fp16 2.5% of its throughput.
    # The overflow check GradScaler needs is read before the update, as a hand GradScaler loop does.
    # A small initial scale: no step is skipped, so each reaches the update the check is about.
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    model = _net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    update = optimizer.optimizer.step

    def update_then_forbid_reads(*args, **kwargs):
        out = update(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")  # from here on, a synchronizing call raises
        return out

    optimizer.optimizer.step = update_then_forbid_reads
    x = torch.randn(8, 16, device="cuda")
    try:
        for _ in range(3):
            optimizer.zero_grad()
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            torch.cuda.set_sync_debug_mode("default")
            assert accelerator.optimizer_step_was_skipped is False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bf16_autocasts_on_cuda_and_keeps_fp32_weights():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(_net())
    inner = []
    model[0].register_forward_hook(lambda mod, args, out: inner.append(out.dtype))
    out = model(torch.randn(4, 16, device="cuda"))
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with accelerator.autocast():
        assert (torch.randn(4, 4, device="cuda") @ torch.randn(4, 4, device="cuda")).dtype == torch.bfloat16


def _fit(project, max_steps, resume_from=None, every_n_steps=None):
    module = Regression()
    callbacks = [MixedPrecision("fp16"), GradClip(max_norm=0.5)]
    if every_n_steps:
        callbacks.append(Checkpointer(every_n_steps=every_n_steps))
    trainer = Trainer(project_dir=project, max_steps=max_steps, resume_from=resume_from, callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _loader())
    return module, trainer


def test_fp16_trainer_resumed_mid_epoch_on_cuda_ends_bitwise_identical(tmp_path):
    # 12 batches an epoch: the interruption at step 17 is mid-epoch 1, with dropout and a GradScaler.
    reference, reference_trainer = _fit(tmp_path / "whole", max_steps=30)
    _fit(tmp_path / "cut", max_steps=17, every_n_steps=17)
    checkpoint = run_folder(tmp_path / "cut") / "checkpoint_0"
    saved = torch.load(checkpoint / "random_states_0.pt", weights_only=True)
    assert "cuda" in saved, "the CUDA generator's state must be in the checkpoint"
    resumed, resumed_trainer = _fit(tmp_path / "cut", max_steps=30, resume_from=checkpoint)
    assert next(resumed.parameters()).device.type == "cuda"
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after the resume"
    assert (resumed_trainer.accelerator.precision.scaler.get_scale()
            == reference_trainer.accelerator.precision.scaler.get_scale())


def test_a_checkpoint_of_gpu_tensors_loads_on_the_cpu(tmp_path):
    accelerator = Accelerator(mixed_precision="fp16")
    torch.manual_seed(0)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(8, 16, device="cuda")).pow(2).mean())
    optimizer.step()
    accelerator.save_state(tmp_path / "state")

    cpu = Accelerator(cpu=True, mixed_precision="fp16")
    torch.manual_seed(5)
    other = _net()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other, other_optimizer = cpu.prepare(other, other_optimizer)
    cpu.load_state(tmp_path / "state")
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert b.device.type == "cpu" and torch.equal(a.cpu(), b)
    assert cpu.precision.scaler.get_scale() == accelerator.precision.scaler.get_scale()
    exp_avg = next(iter(other_optimizer.state.values()))["exp_avg"]
    assert exp_avg.device.type == "cpu"


@pytest.mark.subprocess
def test_the_gpu_benchmark_runs_at_tiny_sizes():
    command = [sys.executable, "-m", "benchmarks.gpu", "--quick", "--d-model", "64", "--heads", "4", "--layers", "2",
               "--seq", "32", "--batch", "4", "--vocab", "256", "--steps", "5", "--warmup", "2", "--repeats", "1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert "| fittrain Trainer.fit + MixedPrecision | bf16 |" in done.stdout
    assert "CUDA" in done.stdout  # the machine line names the CUDA version
