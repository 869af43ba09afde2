"""Accelerate's save_state / load_state pre-hooks: a model saved the hook's own way (as diffusers
scripts do), inside the checkpoint, atomic and checksummed with it."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fittrain import Accelerator, CheckpointError
from fittrain.checkpoint import is_intact


def _accelerator_with_hooks(saved: list[str]) -> tuple[Accelerator, nn.Module, nn.Module]:
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    first, second = acc.prepare(nn.Linear(3, 2), nn.Linear(2, 1))

    def save_hook(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
        saved.append(output_dir)
        os.makedirs(os.path.join(output_dir, "second"))
        save_file(models[1].state_dict(), os.path.join(output_dir, "second", "weights.safetensors"))
        weights.pop()  # fittrain writes only the first model

    def load_hook(models: list[nn.Module], input_dir: str) -> None:
        model = models.pop()
        model.load_state_dict(load_file(os.path.join(input_dir, "second", "weights.safetensors")))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    return acc, first, second


@pytest.mark.parametrize("async_save", [False, True])
def test_a_model_saved_by_hooks_travels_inside_the_checkpoint(tmp_path: pathlib.Path, async_save: bool) -> None:
    staged: list[str] = []
    acc, first, second = _accelerator_with_hooks(staged)
    expected = [{k: v.clone() for k, v in m.state_dict().items()} for m in (first, second)]
    folder = tmp_path / "checkpoint"
    acc.save_state(folder, async_save=async_save)
    acc.wait_for_checkpoint()
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert "second/weights.safetensors" in files and "model.safetensors" in files and "model_1.safetensors" not in files
    assert is_intact(folder) and not os.path.exists(staged[0])  # the staging folder is gone
    with torch.no_grad():
        for model in (first, second):
            for p in model.parameters():
                p.add_(1.0)
    acc.load_state(folder)
    for model, state in zip((first, second), expected):
        for key, value in state.items():
            assert torch.equal(model.state_dict()[key], value)


def test_a_damaged_hook_file_is_named_on_load(tmp_path: pathlib.Path) -> None:
    acc, _, _ = _accelerator_with_hooks([])
    acc.save_state(tmp_path / "checkpoint")
    hook_file = tmp_path / "checkpoint" / "second" / "weights.safetensors"
    data = bytearray(hook_file.read_bytes())
    data[-1] ^= 0xFF
    hook_file.write_bytes(bytes(data))
    assert not is_intact(tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match="second/weights.safetensors' is damaged: checksum mismatch"):
        acc.load_state(tmp_path / "checkpoint")  # before the load hook reads it


def test_removed_hooks_no_longer_run_and_clashing_names_are_refused(tmp_path: pathlib.Path) -> None:
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 1))
    calls = []
    handle = acc.register_save_state_pre_hook(lambda models, weights, out: calls.append(out))
    handle.remove()
    acc.save_state(tmp_path / "a")
    assert calls == []

    def clash(models: list, weights: list, output_dir: str) -> None:
        pathlib.Path(output_dir, "model.safetensors").write_bytes(b"mine")

    acc.register_save_state_pre_hook(clash)
    with pytest.raises(CheckpointError, match="'model.safetensors', a name the checkpoint itself uses"):
        acc.save_state(tmp_path / "b")
    assert not (tmp_path / "b").exists()
    with pytest.raises(TypeError, match="register_load_state_pre_hook\\(\\) takes a function"):
        acc.register_load_state_pre_hook("not a function")


def test_a_manifest_entry_leaving_the_folder_is_refused(tmp_path: pathlib.Path) -> None:
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 1))
    acc.save_state(tmp_path / "checkpoint")
    manifest_path = tmp_path / "checkpoint" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (tmp_path / "outside.txt").write_bytes(b"x")
    manifest["files"]["sub/../../outside.txt"] = {"size": 1, "crc32": 0}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is not a valid version-1 fittrain manifest"):
        acc.load_state(tmp_path / "checkpoint")
