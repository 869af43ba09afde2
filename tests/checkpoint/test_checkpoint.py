"""save_state/load_state through the Accelerator (fittrain/checkpoint/): exact resume, naming,
the folder layout, and bad checkpoints that must fail loudly without changing anything.

The storage layer (atomic folders, manifests, guarded reads) has its own tests in
tests/checkpoint/test_storage.py; these tests go through the public Accelerator API.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pathlib
import random
import zlib
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader

from fittrain import Accelerator, CheckpointError, ProjectConfiguration
from support.models import regression_data

STEPS_BEFORE_SAVE = 3  # batches of epoch 0 trained before the checkpoint
BATCHES_PER_EPOCH = 6


class Net(nn.Module):
    """A model whose forward draws from torch's global RNG (dropout)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class LossWeight:
    """A registered object whose state changes every step and feeds the loss."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weight, self.updates = float(state["weight"]), int(state["updates"])

    def update(self) -> None:
        self.weight *= 0.97
        self.updates += 1


@dataclasses.dataclass
class Run:
    accelerator: Accelerator
    model: nn.Module
    optimizer: Any
    scheduler: Any
    loader: Any
    weight: LossWeight


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(seed: int, **accelerator_kwargs: Any) -> Run:
    """A fresh training setup, as a new process would build it; `seed` sets every RNG first."""
    seed_everything(seed)
    accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
    loader = DataLoader(regression_data(BATCHES_PER_EPOCH * 4, in_features=4), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    weight = LossWeight()
    accelerator.register_for_checkpointing(weight)
    return Run(accelerator, model, optimizer, scheduler, loader, weight)


def train_step(run: Run, batch: Any) -> torch.Tensor:
    """One step whose loss depends on dropout, Python's and NumPy's RNGs and the registered object."""
    x, y = batch
    loss = nn.functional.mse_loss(run.model(x), y) * run.weight.weight
    loss = loss + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
    run.accelerator.backward(loss)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad()
    run.weight.update()
    return loss.detach()


def train_and_save(path: pathlib.Path) -> tuple[Run, list[torch.Tensor]]:
    """Trains part of epoch 0, saves, then records the losses of the rest of epoch 0 and epoch 1."""
    run = build(seed=0)
    after_save = []
    for i, batch in enumerate(run.loader):
        loss = train_step(run, batch)
        if i + 1 == STEPS_BEFORE_SAVE:
            run.accelerator.save_state(path)
        elif i + 1 > STEPS_BEFORE_SAVE:
            after_save.append(loss)
    after_save += [train_step(run, batch) for batch in run.loader]
    return run, after_save


def resume(path: pathlib.Path, perturb: Any = None) -> tuple[Run, list[torch.Tensor]]:
    """A new setup (other seeds, other initial weights) that loads the checkpoint and trains on."""
    run = build(seed=1234)
    run.accelerator.load_state(path)
    if perturb is not None:
        perturb()
    consumed = run.loader.state_dict()["batches_consumed"]
    losses = [train_step(run, b) for b in run.accelerator.skip_first_batches(run.loader, consumed)]
    losses += [train_step(run, b) for b in run.loader]
    return run, losses


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    """Every file and folder under `folder`, with a hash of each file's bytes."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "<dir>"
    return out


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------ exact resume
def test_save_then_load_reproduces_the_next_losses_exactly(tmp_path):
    original, want = train_and_save(tmp_path / "ckpt")
    assert len(want) == BATCHES_PER_EPOCH - STEPS_BEFORE_SAVE + BATCHES_PER_EPOCH

    resumed, got = resume(tmp_path / "ckpt")
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert all(torch.equal(a, b) for a, b in zip(params(resumed.model), params(original.model)))
    assert resumed.scheduler.get_last_lr() == original.scheduler.get_last_lr()
    assert resumed.weight.state_dict() == original.weight.state_dict()
    assert resumed.accelerator.step == original.accelerator.step


@pytest.mark.parametrize("perturb", [
    lambda: random.random(), lambda: np.random.rand(), lambda: torch.rand(1),
], ids=["python", "numpy", "torch"])
def test_each_rng_is_part_of_the_exact_resume(tmp_path, perturb):
    # Control for the test above: if any one RNG were not restored, the losses would differ.
    _, want = train_and_save(tmp_path / "ckpt")
    _, got = resume(tmp_path / "ckpt", perturb=perturb)
    assert not torch.equal(got[0], want[0])


# ------------------------------------------------------------------ automatic naming
def test_automatic_naming_keeps_total_limit_and_loads_the_newest(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    run = build(seed=0, project_config=config)
    saved = []
    batches = iter(run.loader)
    for _ in range(4):
        train_step(run, next(batches))
        run.accelerator.save_state()
        saved.append(params(run.model))
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]

    train_step(run, next(batches))
    loaded = run.accelerator.load_state()
    assert pathlib.Path(loaded) == root / "checkpoint_3"
    assert all(torch.equal(a, b) for a, b in zip(params(run.model), saved[3]))

    # Numbering continues after the newest, and the limit still holds.
    run.accelerator.save_state()
    assert sorted(os.listdir(root)) == ["checkpoint_3", "checkpoint_4"]


def test_a_new_run_continues_the_numbering_of_existing_checkpoints(tmp_path):
    def config() -> ProjectConfiguration:
        return ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)

    first = build(seed=0, project_config=config())
    first.accelerator.save_state()
    first.accelerator.save_state()
    second = build(seed=0, project_config=config())
    assert pathlib.Path(second.accelerator.save_state()).name == "checkpoint_2"


def test_load_state_without_a_folder_needs_automatic_naming_or_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="input_dir"):
        build(seed=0).accelerator.load_state()
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        build(seed=0, project_config=config).accelerator.load_state()
    assert list(tmp_path.iterdir()) == []


def test_save_state_without_a_folder_needs_automatic_naming(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="output_dir"):
        build(seed=0).accelerator.save_state()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the folder layout
def test_checkpoint_folder_layout(tmp_path):
    run = build(seed=0)
    for batch in run.loader:
        train_step(run, batch)
    folder = tmp_path / "ckpt"
    assert run.accelerator.save_state(folder) == str(folder)

    names = set(os.listdir(folder))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "random_states_0.pt",
            "custom_checkpoint_0.pt", "accelerator_state.json", "manifest.json"} <= names
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary or backup folder left beside it

    # Weights load with safetensors alone and are the unwrapped model's state_dict.
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    want = run.accelerator.unwrap_model(run.model).state_dict()
    assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want)

    # Everything else loads without unpickling arbitrary objects.
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert optimizer["param_groups"][0]["lr"] == run.optimizer.param_groups[0]["lr"]
    assert torch.equal(optimizer["state"][0]["exp_avg"], run.optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.load(folder / "scheduler.pt", weights_only=True)["last_epoch"] == BATCHES_PER_EPOCH
    assert torch.load(folder / "custom_checkpoint_0.pt", weights_only=True) == run.weight.state_dict()
    rng = torch.load(folder / "random_states_0.pt", weights_only=True)
    assert isinstance(rng["torch"], torch.Tensor)
    meta = json.loads((folder / "accelerator_state.json").read_text())
    # The JSON lists the positions; the loader's full state (with its RNG capture) is in data_states_0.pt.
    full = run.loader.state_dict()
    assert meta["dataloaders"] == [{k: full[k] for k in ("seed", "epoch", "batches_consumed", "order_consumed")}]
    saved = torch.load(folder / "data_states_0.pt", weights_only=True)
    assert len(saved) == 1 and torch.equal(saved[0]["order"]["pass"]["rng"], full["order"]["pass"]["rng"])

    # The manifest lists every other file with its real size and checksum.
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == names - {"manifest.json"}
    for name, record in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}


def test_fp16_scaler_and_a_second_model_get_their_own_files(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    first, second = nn.Linear(2, 2), nn.Linear(2, 3)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    first, second, optimizer = accelerator.prepare(first, second, optimizer)
    accelerator.backward(first(torch.ones(1, 2)).sum() + second(torch.ones(1, 2)).sum())
    optimizer.step()
    accelerator.save_state(tmp_path / "ckpt")
    assert safetensors.torch.load_file(tmp_path / "ckpt" / "model_1.safetensors")["weight"].shape == (3, 2)
    scaler = torch.load(tmp_path / "ckpt" / "scaler.pt", weights_only=True)
    assert scaler["scale"] == accelerator.precision.scaler.get_scale()


def test_saving_again_to_the_same_folder_replaces_it(tmp_path):
    run = build(seed=0)
    run.accelerator.save_state(tmp_path / "ckpt")
    train_step(run, next(iter(run.loader)))
    run.accelerator.save_state(tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]
    weights = safetensors.torch.load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(weights["body.0.weight"], run.model.body[0].weight.detach())


# ------------------------------------------------------------------ bad input: nothing changes
@pytest.fixture
def saved_then_trained(tmp_path):
    """A checkpoint, and a run that trained on past it (so a load would visibly change things)."""
    run = build(seed=0)
    batches = iter(run.loader)
    train_step(run, next(batches))
    folder = tmp_path / "ckpt"
    run.accelerator.save_state(folder)
    train_step(run, next(batches))
    return run, folder


def live_state(run: Run) -> dict[str, Any]:
    return {"params": params(run.model), "optimizer": run.optimizer.state_dict()["state"][0]["exp_avg"].clone(),
            "lr": run.scheduler.get_last_lr(), "weight": run.weight.state_dict(), "rng": torch.get_rng_state(),
            "loader": run.loader.state_dict()}


def assert_unchanged(run: Run, before: dict[str, Any]) -> None:
    after = live_state(run)
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"]))
    assert torch.equal(after["optimizer"], before["optimizer"])
    assert after["lr"] == before["lr"] and after["weight"] == before["weight"]
    assert torch.equal(after["rng"], before["rng"]) and after["loader"] == before["loader"]


def rewrite_manifest_entry(folder: pathlib.Path, name: str) -> None:
    """Makes the manifest agree with a tampered file, so only the content checks can catch it."""
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_load_state_of_a_missing_folder_names_the_path(tmp_path):
    run = build(seed=0)
    train_step(run, next(iter(run.loader)))
    missing = tmp_path / "no" / "such_checkpoint"
    before = live_state(run)
    with pytest.raises(FileNotFoundError) as info:
        run.accelerator.load_state(missing)
    assert str(missing) in str(info.value)
    assert not (tmp_path / "no").exists()
    assert_unchanged(run, before)


@pytest.mark.parametrize("manifest_agrees", [False, True], ids=["size-check", "decoder"])
def test_truncated_model_file_is_refused_and_the_model_is_untouched(saved_then_trained, manifest_agrees):
    run, folder = saved_then_trained
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if manifest_agrees:
        rewrite_manifest_entry(folder, "model.safetensors")
    on_disk, before = snapshot(folder), live_state(run)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        run.accelerator.load_state(folder)
    assert_unchanged(run, before)
    assert snapshot(folder) == on_disk


def test_flipped_byte_in_optimizer_file_is_refused(saved_then_trained):
    run, folder = saved_then_trained
    path = folder / "optimizer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    on_disk, before = snapshot(folder), live_state(run)
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        run.accelerator.load_state(folder)
    # The model file, read before the optimizer's, was not applied either: no half-load.
    assert_unchanged(run, before)
    assert snapshot(folder) == on_disk


class Payload:
    """Unpickling this runs open(marker, 'w'), creating the marker file."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("target", ["optimizer.pt", "custom_checkpoint_0.pt", "random_states_0.pt"])
def test_planted_pickle_is_refused_and_never_executed(saved_then_trained, tmp_path, target):
    run, folder = saved_then_trained
    # Control: this payload really executes when unpickled without the guard.
    control = tmp_path / "control_marker"
    buffer = io.BytesIO()
    torch.save({"state": Payload(control)}, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)
    assert control.exists()

    marker = tmp_path / "marker"
    torch.save({"state": Payload(marker)}, folder / target)
    rewrite_manifest_entry(folder, target)  # only the unpickling guard stands in the way
    on_disk, before = snapshot(folder), live_state(run)
    with pytest.raises(CheckpointError, match=target.replace(".", r"\.")):
        run.accelerator.load_state(folder)
    assert not marker.exists()
    assert_unchanged(run, before)
    assert snapshot(folder) == on_disk


def test_a_checkpoint_of_another_architecture_changes_nothing(saved_then_trained):
    run, folder = saved_then_trained
    other = build(seed=1)
    train_step(other, next(iter(other.loader)))
    # Same first layer, different head: torch's load_state_dict would copy the first layer, then fail.
    other.accelerator.prepared.models[0].body[3] = nn.Linear(16, 2)
    before = live_state(other)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        other.accelerator.load_state(folder)
    assert_unchanged(other, before)


@pytest.mark.parametrize("bad", [object(), 42, type("OnlySave", (), {"state_dict": lambda self: {}})()],
                         ids=["object", "int", "state_dict-only"])
def test_register_for_checkpointing_refuses_objects_without_state_methods(tmp_path, bad):
    accelerator = Accelerator(cpu=True)
    good = LossWeight()
    with pytest.raises(ValueError) as info:
        accelerator.register_for_checkpointing(good, bad)
    message = str(info.value)
    assert "state_dict" in message and "load_state_dict" in message and type(bad).__name__ in message
    # Nothing was registered, not even the valid object given alongside.
    accelerator.save_state(tmp_path / "ckpt")
    assert not any(n.startswith("custom_checkpoint") for n in os.listdir(tmp_path / "ckpt"))
