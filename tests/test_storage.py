"""Tests for fittrain.storage: atomic checkpoint folders, the manifest and verified reads."""

from __future__ import annotations

import io
import json
import os
import pathlib
import threading
import zlib

import pytest
import safetensors.torch
import torch

from fittrain.storage import (
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
