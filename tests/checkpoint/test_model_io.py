"""Tests for fittrain.checkpoint.model_io: safetensors weights, sharding, tied weights and parse_size."""

from __future__ import annotations

import json

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from fittrain.checkpoint import CheckpointError
from fittrain.checkpoint.model_io import load_model_weights, parse_size, save_model_weights


def _state_dict(count: int = 6, size: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(size, generator=generator) for i in range(count)}


def _assert_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert set(left) == set(right)
    for key in left:
        assert torch.equal(left[key], right[key]), key


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight


def test_single_file(tmp_path):
    weights = _state_dict()
    written = save_model_weights(weights, tmp_path / "out")
    assert written == [tmp_path / "out" / "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    _assert_equal(safetensors.torch.load_file(written[0]), weights)
    _assert_equal(load_model_weights(tmp_path / "out"), weights)
    with safetensors.safe_open(written[0], framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharding_writes_shards_and_an_index(tmp_path):
    weights = _state_dict(count=6, size=100)  # 400 bytes each: two fit under 1KB.
    written = save_model_weights(weights, tmp_path, max_shard_size="1KB")
    names = [p.name for p in written]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 400
    assert set(index["weight_map"]) == set(weights)
    assert index["weight_map"]["layer0.weight"] == "model-00001-of-00003.safetensors"
    assert index["weight_map"]["layer5.weight"] == "model-00003-of-00003.safetensors"
    for name in names[:-1]:
        assert (tmp_path / name).stat().st_size < 1000 + 500  # Tensor bytes plus a small header.
    _assert_equal(load_model_weights(tmp_path), weights)


def test_tensor_larger_than_the_limit_gets_its_own_shard(tmp_path):
    weights = {"small": torch.zeros(10), "big": torch.zeros(1000), "tail": torch.zeros(10)}
    save_model_weights(weights, tmp_path, max_shard_size=100)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {
        "small": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "tail": "model-00003-of-00003.safetensors",
    }


def test_tied_weights_load_strictly_with_safetensors_alone(tmp_path):
    model = _Tied()
    save_model_weights(model.state_dict(), tmp_path)
    loaded = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert set(loaded) == {"embed.weight", "head.weight"}
    fresh = _Tied()
    fresh.load_state_dict(loaded, strict=True)
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight


def test_tensors_are_made_contiguous_and_detached(tmp_path):
    base = torch.arange(6.0).reshape(2, 3).requires_grad_()
    save_model_weights({"t": base.t(), "p": nn.Parameter(torch.ones(2))}, tmp_path)
    loaded = load_model_weights(tmp_path)
    assert torch.equal(loaded["t"], base.detach().t()) and not loaded["p"].requires_grad


def test_unsafe_serialization_writes_bin_files(tmp_path):
    weights = _state_dict()
    written = save_model_weights(weights, tmp_path, safe_serialization=False)
    assert [p.name for p in written] == ["pytorch_model.bin"]
    _assert_equal(torch.load(written[0], weights_only=True), weights)
    _assert_equal(load_model_weights(tmp_path), weights)


def test_unsafe_serialization_shards(tmp_path):
    weights = _state_dict(count=4, size=100)
    written = save_model_weights(weights, tmp_path, max_shard_size="800B", safe_serialization=False)
    assert [p.name for p in written] == [
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    for path in written[:-1]:
        shard = torch.load(path, weights_only=True)
        assert all(isinstance(t, torch.Tensor) for t in shard.values())
    _assert_equal(load_model_weights(tmp_path), weights)


def test_resave_as_single_file_removes_stale_shards(tmp_path):
    save_model_weights(_state_dict(count=6, size=100), tmp_path, max_shard_size="1KB")
    (tmp_path / "notes.txt").write_text("keep me")
    weights = _state_dict(count=2)
    save_model_weights(weights, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    _assert_equal(load_model_weights(tmp_path), weights)


def test_resave_with_fewer_shards_removes_the_extra_ones(tmp_path):
    save_model_weights(_state_dict(count=6, size=100), tmp_path, max_shard_size="1KB")
    save_model_weights(_state_dict(count=4, size=100), tmp_path, max_shard_size="1KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_load_missing_weights_names_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin") as info:
        load_model_weights(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_load_refuses_damaged_or_unsafe_files(tmp_path):
    save_model_weights(_state_dict(), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model_weights(tmp_path)
    path.unlink()
    torch.save({"w": torch.zeros(1), "fn": print}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*nothing in it was executed"):
        load_model_weights(tmp_path)


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
    save_model_weights(_state_dict(count=6, size=100), tmp_path, max_shard_size="1KB")
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors"):
        load_model_weights(tmp_path)


@pytest.mark.parametrize("index", [
    "[" * 100_000 + "]" * 100_000,  # deeper than the JSON decoder's recursion
    '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"weight_map": ["model-00001-of-00002.safetensors"]}',
    '{"weight_map": {"w": 5}}',
])
def test_a_damaged_index_is_named(tmp_path, index):
    save_model_weights(_state_dict(count=6, size=100), tmp_path, max_shard_size="1KB")
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=r"Index file .*model\.safetensors\.index\.json' is damaged") as info:
        load_model_weights(tmp_path)
    assert len(str(info.value)) < 400, str(info.value)


def test_bad_state_dict_values_are_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="'step'.*int"):
        save_model_weights({"w": torch.zeros(1), "step": 3}, tmp_path)
    with pytest.raises(ValueError, match="meta device"):
        save_model_weights({"w": torch.empty(2, device="meta")}, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (123, 123), ("10GB", 10 * 10**9), ("5MB", 5 * 10**6), ("500KB", 500_000),
        ("1.5GiB", 3 * 2**29), ("100B", 100), ("5mb", 5 * 10**6), ("2kib", 2048),
        (" 1.1 KB ", 1100), ("4096", 4096), ("1TB", 10**12),
    ],
)
def test_parse_size_accepts(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["huge", "", "5 XB", "-1MB", "MB", 0, -5, True, 1.5, None, "0.1B"])
def test_parse_size_rejects_with_a_helpful_message(size):
    expected = r"`max_shard_size` must be .*'5MB'.*Received: max_shard_size="
    with pytest.raises(ValueError, match=expected):
        parse_size(size)


def test_parse_size_names_the_argument_and_save_checks_it_first(tmp_path):
    with pytest.raises(ValueError, match="Received: limit='x'"):
        parse_size("x", argument="limit")
    with pytest.raises(ValueError, match="max_shard_size='huge'"):
        save_model_weights({"w": torch.zeros(1)}, tmp_path / "out", max_shard_size="huge")
    assert not (tmp_path / "out").exists()
