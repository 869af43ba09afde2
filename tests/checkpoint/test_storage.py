"""Tests for fittrain.checkpoint.folder and .reader: atomic checkpoint folders, the manifest and verified reads."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import threading
import zlib

import pytest
import safetensors.torch
import torch

from fittrain.checkpoint import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    atomic_checkpoint,
    is_intact,
    list_checkpoints,
)


def _write_sample(final: pathlib.Path) -> None:
    with atomic_checkpoint(final) as writer:
        writer.write_tensors("model.safetensors", {"w": torch.arange(6.0).reshape(2, 3)})
        writer.write_torch("optimizer.pt", {"state": {0: {"step": torch.tensor(3.0)}}, "lr": 0.1})
        writer.write_json("trainer_state.json", {"global_step": 7})
        writer.write_bytes("raw.bin", b"\x00\x01\x02")


class _Planted:
    """Pickles to a call of open(marker, "w"), which creates the marker file if ever executed."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def test_every_kind_round_trips(tmp_path):
    final = tmp_path / "checkpoint_0"
    _write_sample(final)
    reader = CheckpointReader(final)
    assert reader.path == final
    assert reader.names() == ["model.safetensors", "optimizer.pt", "raw.bin", "trainer_state.json"]
    assert reader.has("optimizer.pt") and not reader.has(MANIFEST_NAME)
    model = reader.read_tensors("model.safetensors")
    assert torch.equal(model["w"], torch.arange(6.0).reshape(2, 3))
    optimizer = reader.read_torch("optimizer.pt")
    assert optimizer["lr"] == 0.1 and torch.equal(optimizer["state"][0]["step"], torch.tensor(3.0))
    assert reader.read_json("trainer_state.json") == {"global_step": 7}
    assert reader.read_bytes("raw.bin") == b"\x00\x01\x02"
    reader.verify()


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    final = tmp_path / "ckpt"
    _write_sample(final)
    manifest = json.loads((final / MANIFEST_NAME).read_text())
    assert manifest["format"] == "fittrain-checkpoint" and manifest["version"] == 1
    on_disk = {p.name for p in final.iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk
    for name, record in manifest["files"].items():
        data = (final / name).read_bytes()
        assert record == {"size": len(data), "crc32": zlib.crc32(data)}


def test_write_tensors_moves_to_cpu_makes_contiguous_and_unties(tmp_path):
    shared = torch.ones(2, 3)
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_tensors("t.safetensors", {"a": shared, "b": shared, "t": shared.t()},
                             metadata={"note": "x"})
    loaded = CheckpointReader(tmp_path / "c").read_tensors("t.safetensors")
    assert set(loaded) == {"a", "b", "t"} and torch.equal(loaded["t"], torch.ones(3, 2))


def test_final_folder_appears_only_after_the_block(tmp_path):
    final = tmp_path / "sub" / "checkpoint_1"
    with atomic_checkpoint(final) as writer:
        writer.write_json("a.json", [1])
        assert not final.exists()
        assert writer.path == tmp_path / "sub" / ".checkpoint_1.tmp"
        assert writer.path.is_dir()
    assert final.is_dir() and (final / MANIFEST_NAME).is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == ["checkpoint_1"]


def test_exception_leaves_neither_final_nor_temp_folder(tmp_path):
    final = tmp_path / "checkpoint_2"
    with pytest.raises(KeyError, match="boom"):
        with atomic_checkpoint(final) as writer:
            writer.write_json("a.json", {})
            raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_a_complete_checkpoint_with_a_complete_one(tmp_path):
    final = tmp_path / "checkpoint_3"
    _write_sample(final)
    with atomic_checkpoint(final) as writer:
        writer.write_json("only.json", {"new": True})
        assert is_intact(final)  # The old folder stays complete while the new one is written.
    assert CheckpointReader(final).names() == ["only.json"]
    assert is_intact(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_3"]


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path):
    final = tmp_path / "checkpoint_3"
    _write_sample(final)
    with pytest.raises(RuntimeError):
        with atomic_checkpoint(final) as writer:
            writer.write_json("only.json", {})
            raise RuntimeError("crash")
    assert is_intact(final) and CheckpointReader(final).has("optimizer.pt")


def test_failed_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    """The fallback for systems without renameat2(RENAME_EXCHANGE): two renames, undone on failure."""
    import fittrain.checkpoint.renames

    monkeypatch.setattr(fittrain.checkpoint.renames, "_RENAMEAT2", None)
    final = tmp_path / "checkpoint_3"
    _write_sample(final)
    real_rename = os.rename

    def rename(src, dst):
        if pathlib.Path(src).name == ".checkpoint_3.tmp":
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk full"):
        with atomic_checkpoint(final) as writer:
            writer.write_json("only.json", {})
    assert is_intact(final) and CheckpointReader(final).has("optimizer.pt")


def test_stale_temp_and_old_folders_are_cleaned_up(tmp_path):
    final = tmp_path / "checkpoint_4"
    _write_sample(final)
    (tmp_path / ".checkpoint_4.tmp").mkdir()
    (tmp_path / ".checkpoint_4.tmp" / "junk").write_bytes(b"x")
    (tmp_path / ".checkpoint_4.old").mkdir()
    with atomic_checkpoint(final) as writer:
        writer.write_json("a.json", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_4"]
    assert CheckpointReader(final).names() == ["a.json"]


def test_barrier_is_called_once_on_enter_and_twice_on_exit(tmp_path):
    final = tmp_path / "c"
    temp = tmp_path / ".c.tmp"
    seen: list[tuple[bool, bool, bool]] = []

    def barrier() -> None:
        seen.append((temp.is_dir(), (temp / MANIFEST_NAME).exists(), final.exists()))

    with atomic_checkpoint(final, barrier=barrier) as writer:
        assert seen == [(True, False, False)]  # After the temp folder exists.
        writer.write_json("a.json", 1)
    # Before the manifest is written, then after the folder is in place.
    assert seen == [(True, False, False), (True, False, False), (False, False, True)]


def test_no_barrier_on_the_error_path(tmp_path):
    calls: list[int] = []
    with pytest.raises(ValueError):
        with atomic_checkpoint(tmp_path / "c", barrier=lambda: calls.append(1)):
            raise ValueError("x")
    assert calls == [1]


def test_two_ranks_share_one_folder_and_one_manifest(tmp_path):
    final = tmp_path / "checkpoint_5"
    sync = threading.Barrier(2, timeout=10)
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            with atomic_checkpoint(final, is_main_process=index == 0, barrier=sync.wait) as writer:
                writer.write_torch(f"rng_{index}.pt", {"state": torch.full((4,), float(index))})
        except BaseException as err:  # Surfaced by the main thread below.
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    reader = CheckpointReader(final)
    assert reader.names() == ["rng_0.pt", "rng_1.pt"]
    reader.verify()
    assert torch.equal(reader.read_torch("rng_1.pt")["state"], torch.ones(4))


def test_truncated_safetensors_file_names_the_file(tmp_path):
    _write_sample(tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-5])
    reader = CheckpointReader(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*damaged: expected \d+ bytes"):
        reader.read_tensors("model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        reader.verify()
    assert not is_intact(tmp_path / "c")


def test_flipped_byte_in_pt_file_names_the_file(tmp_path):
    _write_sample(tmp_path / "c")
    path = tmp_path / "c" / "optimizer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*checksum mismatch"):
        CheckpointReader(tmp_path / "c").read_torch("optimizer.pt")


def test_unlisted_and_missing_files_are_errors(tmp_path):
    _write_sample(tmp_path / "c")
    (tmp_path / "c" / "raw.bin").unlink()
    reader = CheckpointReader(tmp_path / "c")
    with pytest.raises(CheckpointError, match="'absent.pt'"):
        reader.read_torch("absent.pt")
    with pytest.raises(CheckpointError, match=r"raw\.bin.*missing"):
        reader.read_bytes("raw.bin")


def test_folder_without_manifest_is_incomplete(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"incomplete.*manifest\.json"):
        CheckpointReader(tmp_path / "c")
    assert not is_intact(tmp_path / "c")


def test_malformed_manifest_names_manifest(tmp_path):
    _write_sample(tmp_path / "c")
    (tmp_path / "c" / MANIFEST_NAME).write_text('{"format": "fittrain-checkpoint"')
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        CheckpointReader(tmp_path / "c")
    escaping = {"format": "fittrain-checkpoint", "version": 1,
                "files": {"../x": {"size": 1, "crc32": 0}}}
    (tmp_path / "c" / MANIFEST_NAME).write_text(json.dumps(escaping))
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        CheckpointReader(tmp_path / "c")


def test_missing_folder_is_file_not_found_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        CheckpointReader(missing)
    assert not is_intact(missing)


def test_bad_file_names_are_refused(tmp_path):
    with atomic_checkpoint(tmp_path / "c") as writer:
        for bad in ("../escape.json", "a/b.json", MANIFEST_NAME, ""):
            with pytest.raises(ValueError, match="Received: name="):
                writer.write_json(bad, 1)
    assert not (tmp_path / "escape.json").exists()


def test_planted_pickle_is_refused_and_never_executed(tmp_path):
    live_marker = tmp_path / "live_marker"
    payload = io.BytesIO()
    torch.save({"x": _Planted(live_marker)}, payload)
    # The payload is live: an unrestricted load does run it.
    torch.load(io.BytesIO(payload.getvalue()), weights_only=False)
    assert live_marker.exists()

    marker = tmp_path / "marker"
    payload = io.BytesIO()
    torch.save({"x": _Planted(marker)}, payload)
    final = tmp_path / "c"
    with atomic_checkpoint(final) as writer:
        writer.write_bytes("evil.pt", payload.getvalue())
    reader = CheckpointReader(final)
    reader.verify()  # Its checksum is right; only its contents are unsafe.
    with pytest.raises(CheckpointError, match=r"evil\.pt.*refused.*never executed") as info:
        reader.read_torch("evil.pt")
    assert not marker.exists()
    assert "weights_only=False" not in str(info.value)  # No advice to load it unsafely.


def test_non_safetensors_contents_name_the_file(tmp_path):
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_bytes("fake.safetensors", b"not safetensors at all")
        writer.write_bytes("fake.json", b"{nope")
    reader = CheckpointReader(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"fake\.safetensors"):
        reader.read_tensors("fake.safetensors")
    with pytest.raises(CheckpointError, match=r"fake\.json"):
        reader.read_json("fake.json")


def test_list_checkpoints_sorts_by_number_and_ignores_others(tmp_path):
    assert list_checkpoints(tmp_path / "missing") == []
    for name in ("checkpoint_10", "checkpoint_2", "checkpoint_x", ".checkpoint_3.tmp", "other_1"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint_7").write_text("a file, not a folder")
    assert list_checkpoints(tmp_path) == [tmp_path / "checkpoint_2", tmp_path / "checkpoint_10"]
    assert list_checkpoints(tmp_path, prefix="other_") == [tmp_path / "other_1"]


def test_is_intact_true_only_for_a_complete_undamaged_folder(tmp_path):
    _write_sample(tmp_path / "c")
    assert is_intact(tmp_path / "c")
    (tmp_path / "c" / "trainer_state.json").write_text('{"global_step": 8}')
    assert not is_intact(tmp_path / "c")


def test_writer_can_be_used_directly(tmp_path):
    writer = CheckpointWriter(tmp_path)
    writer.write_tensors("t.safetensors", {"a": torch.zeros(2)})
    assert writer.path == tmp_path
    assert safetensors.torch.load_file(tmp_path / "t.safetensors")["a"].shape == (2,)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


def _every_dtype() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for dtype in _DTYPES:
        name = str(dtype).split(".")[-1]
        values = torch.randn(3, 5, generator=generator) * 50
        tensors[f"{name}.matrix"] = values.to(dtype)
        tensors[f"{name}.scalar"] = torch.tensor(7).to(dtype)
        tensors[f"{name}.empty"] = torch.zeros(0, 4, dtype=dtype)
    return tensors


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_safetensors_file_is_byte_identical_to_the_library(tmp_path, metadata):
    tensors = _every_dtype()
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_tensors("model.safetensors", tensors, metadata)
    path = tmp_path / "c" / "model.safetensors"
    assert path.read_bytes() == safetensors.torch.save(tensors, metadata)
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_length % 8 == 0
    loaded = safetensors.torch.load_file(path)
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == metadata
        assert torch.equal(f.get_tensor("bfloat16.matrix"), tensors["bfloat16.matrix"])
    read = CheckpointReader(tmp_path / "c").read_tensors("model.safetensors")
    assert all(torch.equal(read[key], value) for key, value in tensors.items())


def test_write_tensors_handles_views_and_non_ascii_keys(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {"transposed": base.t(), "slice": base[1:3, ::2], "ünïcode": torch.ones(2)}
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_tensors("t.safetensors", tensors)
    loaded = safetensors.torch.load_file(tmp_path / "c" / "t.safetensors")
    assert all(torch.equal(loaded[key], value) for key, value in tensors.items())


def test_failed_write_leaves_no_partial_file(tmp_path):
    writer = CheckpointWriter(tmp_path)
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda; the point is the file
        writer.write_torch("bad.pt", {"f": lambda: None})  # Lambdas cannot be pickled.
    with pytest.raises(TypeError):
        writer.write_tensors("bad.safetensors", {"a": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_every_rank_fsyncs_its_files_before_the_rename_barrier(tmp_path, monkeypatch):
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (real_fsync(fd), synced.append(fd))[0])
    calls = 0

    def barrier() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # The barrier that lets the main process rename the folder.
            assert len(synced) == 2, "files must be fsynced before the barrier"

    with atomic_checkpoint(tmp_path / "c", is_main_process=False, barrier=barrier) as writer:
        (tmp_path / ".c.tmp").mkdir()
        writer.write_bytes("a.bin", b"a" * 10)
        writer.write_torch("b.pt", {"x": torch.ones(3)})
    assert calls == 3


def test_failed_fsync_fails_the_save_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    _write_sample(tmp_path / "c")

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output"):
        with atomic_checkpoint(tmp_path / "c") as writer:
            writer.write_json("trainer_state.json", {"global_step": 99})
    monkeypatch.undo()
    assert CheckpointReader(tmp_path / "c").read_json("trainer_state.json") == {"global_step": 7}
    assert not (tmp_path / ".c.tmp").exists()


def test_damaged_file_is_never_parsed(tmp_path, monkeypatch):
    _write_sample(tmp_path / "c")
    path = tmp_path / "c" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # Still a valid safetensors file, with one wrong value.
    path.write_bytes(bytes(data))

    def parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a damaged file must not be parsed")

    monkeypatch.setattr(safetensors.torch, "load_file", parse)
    monkeypatch.setattr(torch, "load", parse)
    reader = CheckpointReader(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*checksum mismatch"):
        reader.read_tensors("model.safetensors")


def test_loaded_files_can_be_deleted_while_their_tensors_live(tmp_path):
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_torch("big.pt", {"x": torch.arange(100_000.0)})
        writer.write_tensors("big.safetensors", {"y": torch.arange(100_000.0)})
    reader = CheckpointReader(tmp_path / "c")
    loaded = reader.read_torch("big.pt")
    tensors = reader.read_tensors("big.safetensors")
    shutil.rmtree(tmp_path / "c")
    loaded["x"] += 1  # Copy-on-write: the tensor stays writable and the file is untouched.
    assert torch.equal(loaded["x"], torch.arange(100_000.0) + 1)
    assert torch.equal(tensors["y"], torch.arange(100_000.0))


def test_empty_and_zero_size_files_round_trip(tmp_path):
    with atomic_checkpoint(tmp_path / "c") as writer:
        writer.write_bytes("empty.bin", b"")
        writer.write_tensors("none.safetensors", {})
    reader = CheckpointReader(tmp_path / "c")
    reader.verify()
    assert reader.read_bytes("empty.bin") == b""
    assert reader.read_tensors("none.safetensors") == {}
    assert (tmp_path / "c" / "none.safetensors").read_bytes() == safetensors.torch.save({})
