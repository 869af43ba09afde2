"""Sharded checkpoints on one process: the layout, exact resume, and what a bad or hostile file gets.

One process writes every shard itself (DCP without a process group), so the format and every
refusal can be tested here; tests/checkpoint/test_sharded_fsdp.py runs 2 and 4 processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys

import pytest
import torch
from torch import nn

from fittrain import Accelerator
from fittrain.accelerator import checkpointing as checkpoint_methods
from fittrain.checkpoint import (
    CheckpointDeletedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointReader,
    load_model_weights,
)
from fittrain.checkpoint.crc import file_checksum
from fittrain.checkpoint.dcp_io import metadata_from_json


def _run(state_dict_type: str = "sharded", width: int = 8, optimizer: type = torch.optim.AdamW):
    accelerator = Accelerator(state_dict_type=state_dict_type)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
    opt = optimizer(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def _steps(parts, n: int, seed: int) -> None:
    accelerator, model, opt, sched = parts
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 4, generator=generator)
        accelerator.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rewrite(folder: pathlib.Path, name: str, data: bytes) -> None:
    """Replaces a file and fixes its manifest entry, as an attacker who knows the format would."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    size, crc = file_checksum(folder / name)
    manifest["files"][name] = {"size": size, "crc32": crc}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    parts = _run()
    _steps(parts, 3, seed=1)
    folder = pathlib.Path(parts[0].save_state(tmp_path / "ckpt"))
    _steps(parts, 2, seed=2)
    return folder, _weights(parts[1])


def test_a_sharded_checkpoint_holds_shards_instead_of_model_files_and_resumes_bitwise(saved) -> None:
    folder, expected = saved
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert {"shards/__0_0.distcp", "shards/metadata.json", "shards/values.pt"} <= set(names)
    assert not [n for n in names if n.startswith(("model", "optimizer"))]
    assert json.loads((folder / "accelerator_state.json").read_text())["state_dict_type"] == "sharded"
    parts = _run()
    parts[0].load_state(folder)
    _steps(parts, 2, seed=2)
    after = _weights(parts[1])
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def test_a_full_run_loads_a_sharded_checkpoint_and_the_other_way_round(saved, tmp_path) -> None:
    folder, expected = saved
    parts = _run(state_dict_type="full")
    parts[0].load_state(folder)
    _steps(parts, 2, seed=2)
    assert all(torch.equal(_weights(parts[1])[k], expected[k]) for k in expected)
    full = pathlib.Path(parts[0].save_state(tmp_path / "full"))
    assert (full / "model.safetensors").is_file() and not (full / "shards").exists()
    sharded = _run()
    sharded[0].load_state(full)
    assert all(torch.equal(_weights(sharded[1])[k], _weights(parts[1])[k]) for k in expected)


def test_load_model_weights_assembles_a_sharded_checkpoints_model(saved, tmp_path) -> None:
    folder, _ = saved
    parts = _run()
    parts[0].load_state(folder)
    weights = load_model_weights(folder)
    assert sorted(weights) == sorted(parts[1].state_dict())
    assert all(torch.equal(weights[k], v) for k, v in parts[1].state_dict().items())


def test_another_model_is_refused_by_name_and_nothing_changes(saved) -> None:
    folder, _ = saved
    parts = _run(width=16)
    before = _weights(parts[1])
    with pytest.raises(CheckpointMismatchError, match=r"'model_0/0.weight'.*shape \(8, 4\).*shape \(16, 4\)"):
        parts[0].load_state(folder)
    assert all(torch.equal(_weights(parts[1])[k], before[k]) for k in before)


def test_another_optimizer_is_refused_by_name(saved) -> None:
    folder, _ = saved
    parts = _run(optimizer=torch.optim.Adam)
    with pytest.raises(CheckpointMismatchError, match=r"\['AdamW'\].*\['Adam'\]"):
        parts[0].load_state(folder)


def test_a_damaged_shard_is_named(saved) -> None:
    folder, _ = saved
    shard = folder / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        _run()[0].load_state(folder)


def _open_files() -> list[str]:
    """The files this process has open (Linux: /proc/self/fd), or [] where that cannot be listed."""
    fds = pathlib.Path("/proc/self/fd")
    if not fds.is_dir():
        return []
    found = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            found.append(os.readlink(fd))
    return sorted(path for path in found if path.startswith("/") and not path.startswith("/dev"))


def _prune(folder: pathlib.Path) -> None:
    """What `total_limit` pruning in another run does to a folder: rename it away, then delete it."""
    gone = folder.with_name(f".{folder.name}.pruned")
    folder.rename(gone)
    shutil.rmtree(gone)


def test_a_folder_pruned_after_its_shards_were_verified_still_loads_whole(tmp_path, monkeypatch) -> None:
    """The shards are read into the live model after everything else was checked and applied; a
    concurrent pruner in between must not leave a load half done (the files are held open)."""
    parts = _run(width=64)
    _steps(parts, 3, seed=1)
    folder = pathlib.Path(parts[0].save_state(tmp_path / "ckpt"))
    saved_weights, saved_schedule = _weights(parts[1]), parts[3].state_dict()
    _steps(parts, 2, seed=2)
    apply_state = checkpoint_methods.apply_state

    def pruned_first(*args, **kwargs):
        _prune(folder)
        return apply_state(*args, **kwargs)

    monkeypatch.setattr(checkpoint_methods, "apply_state", pruned_first)
    open_files = _open_files()
    parts[0].load_state(folder)
    assert not folder.exists()
    assert _open_files() == open_files  # the held shard files were closed when the load ended
    loaded = _weights(parts[1])
    assert all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    assert parts[3].state_dict() == saved_schedule


def test_a_folder_pruned_before_its_shards_were_verified_is_refused_as_deleted(tmp_path, monkeypatch) -> None:
    parts = _run(width=64)
    _steps(parts, 3, seed=1)
    folder = pathlib.Path(parts[0].save_state(tmp_path / "ckpt"))
    _steps(parts, 2, seed=2)
    before, schedule = _weights(parts[1]), parts[3].state_dict()
    verify = CheckpointReader.verify

    def pruned_first(self, names=None):
        if folder.exists():
            _prune(folder)
        return verify(self, names)

    monkeypatch.setattr(CheckpointReader, "verify", pruned_first)
    with pytest.raises(CheckpointDeletedError, match="was deleted or replaced while it was being read"):
        parts[0].load_state(folder)
    assert all(torch.equal(_weights(parts[1])[k], before[k]) for k in before)
    assert parts[3].state_dict() == schedule


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(format="pickle"), "not a fittrain-dcp-metadata file"),
    (lambda m: next(iter(m["tensors"].values())).update(size=[-1, 4]),
     r"not a list of integers from 0 to 2\*\*63 - 1: \[-1, 4\]"),
    (lambda m: next(iter(m["tensors"].values()))["chunks"][0].__setitem__(0, [7, 0]), "lies outside its size"),
    (lambda m: m["storage"][0].update(file="../../etc/passwd"), "storage entry is malformed"),
    (lambda m: next(iter(m["tensors"].values())).update(dtype="object"), "no valid dtype"),
    (lambda m: m["storage"][0].update(length=m["storage"][0]["length"] + 4), "not the size of any of its chunks"),
    (lambda m: m["storage"][0].update(start=10**9), r"at bytes 1000000000 to .* lists as \d+ bytes"),
    (lambda m: m["storage"][0].update(file="__7_0.distcp"), "which the manifest does not list"),
    (lambda m: m.update(items="pickle"), "stored as 'pickle'"),
    (lambda m: m.update(byteorder="big" if sys.byteorder == "little" else "little"), "-endian byte order"),
])
def test_a_hostile_metadata_file_is_refused_before_any_shard_is_read(saved, change, message) -> None:
    folder, _ = saved
    metadata = json.loads((folder / "shards" / "metadata.json").read_text())
    change(metadata)
    _rewrite(folder, "shards/metadata.json", json.dumps(metadata).encode())
    with pytest.raises(CheckpointError, match=message):
        _run()[0].load_state(folder)


def test_values_that_are_not_a_dict_of_states_are_refused(saved) -> None:
    folder, _ = saved
    import io
    buffer = io.BytesIO()
    torch.save([1, 2, 3], buffer)
    _rewrite(folder, "shards/values.pt", buffer.getvalue())
    with pytest.raises(CheckpointError, match="values.pt is damaged"):
        _run()[0].load_state(folder)


def test_metadata_round_trips_through_json(saved) -> None:
    folder, _ = saved
    parsed = metadata_from_json(json.loads((folder / "shards" / "metadata.json").read_text()))
    entry = parsed.state_dict_metadata["model_0/0.weight"]
    assert tuple(entry.size) == (8, 4) and entry.properties.dtype == torch.float32
    assert all(info.relative_path == "__0_0.distcp" for info in parsed.storage_data.values())


@pytest.mark.parametrize("value", ["SHARDED_STATE_DICT", "full_state_dict", "Sharded"])
def test_accelerates_state_dict_type_names_are_accepted(value: str) -> None:
    assert Accelerator(state_dict_type=value).state_dict_type in ("full", "sharded")


def test_the_default_is_full_on_one_process_and_the_variable_sets_it(monkeypatch) -> None:
    # Sharded is the default under FSDP2 on several processes (tests/checkpoint/test_sharded_fsdp.py).
    monkeypatch.delenv("FSDP_STATE_DICT_TYPE", raising=False)
    assert Accelerator().state_dict_type == "full"
    assert Accelerator(strategy="fsdp").state_dict_type == "full"
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    assert Accelerator(strategy="fsdp").state_dict_type == "sharded"


@pytest.mark.parametrize("value", ["local", 3, "SHARDED"])
def test_a_bad_state_dict_type_is_named(value, monkeypatch) -> None:
    if value == "SHARDED":  # from the environment: the message names the variable
        monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT")
        with pytest.raises(ValueError, match="'LOCAL_STATE_DICT' from the FSDP_STATE_DICT_TYPE environment"):
            Accelerator()
        return
    with pytest.raises(ValueError, match=rf"state_dict_type=.*Received: {value!r}"):
        Accelerator(state_dict_type=value)
