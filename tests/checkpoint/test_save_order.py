"""The order of saves in a folder (saves.json), named reservations, pruning by run, deletions that
touch only checkpoints, and the `last` link (fittrain/checkpoint/run_folders.py and naming.py).

Real folders, written with `atomic_checkpoint` where a complete checkpoint is needed.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from fittrain.checkpoint import atomic_checkpoint, is_intact
from fittrain.checkpoint.naming import ProjectConfiguration, delete_checkpoints, reserve_named, reserved_name
from fittrain.checkpoint.run_folders import (
    SAVES_FILE,
    holds_checkpoints,
    link_targets,
    point_link,
    read_saves,
    record_save,
    saved_by,
    saved_in_order,
)
from fittrain.checkpoint.temp_folders import TempFolder


def _checkpoint(folder: pathlib.Path, epoch: int = 0, batches: int = 0) -> pathlib.Path:
    """A complete (tiny) checkpoint whose accelerator_state.json records a data position."""
    with atomic_checkpoint(folder) as writer:
        writer.write_json("accelerator_state.json", {"step": 0, "dataloaders": [
            {"epoch": epoch, "batches_consumed": batches, "order_consumed": 0, "seed": 0}]})
    return folder


def _names(paths: list[pathlib.Path]) -> list[str]:
    return [p.name for p in paths]


def test_numbered_folders_without_saves_json_are_in_number_order(tmp_path):
    for i in (10, 9, 2):
        (tmp_path / f"checkpoint_{i}").mkdir()
    assert _names(saved_in_order(tmp_path)) == ["checkpoint_2", "checkpoint_9", "checkpoint_10"]
    assert saved_in_order(tmp_path / "missing") == []


def test_saves_json_orders_named_saves_and_the_unlisted_come_first_by_data_position(tmp_path):
    for name, epoch in (("epoch=10", 10), ("epoch=9", 9), ("epoch=11", 11)):
        _checkpoint(tmp_path / name, epoch)
        record_save(tmp_path, name, "run_a")
    # Not listed: an older version's, or one whose saves.json entry was lost. Ordered by the data
    # position their accelerator_state.json holds, before every listed one.
    _checkpoint(tmp_path / "b-late", epoch=3, batches=2)
    _checkpoint(tmp_path / "a-early", epoch=3, batches=1)
    # Never candidates: a plain folder, a hidden one, a link, a file.
    (tmp_path / "notes").mkdir()
    (tmp_path / ".checkpoint_7.tmp").mkdir()
    os.symlink("epoch=9", tmp_path / "last")
    (tmp_path / "readme.txt").write_text("x")
    assert _names(saved_in_order(tmp_path)) == ["a-early", "b-late", "epoch=10", "epoch=9", "epoch=11"]
    assert saved_by(tmp_path, "epoch=9") == "run_a" and saved_by(tmp_path, "a-early") is None
    assert holds_checkpoints(tmp_path) and not holds_checkpoints(tmp_path / "notes")


def test_record_save_moves_a_reused_name_last_and_drops_what_is_gone(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        record_save(tmp_path, name, "run")
    (tmp_path / "b").rmdir()  # deleted
    (tmp_path / ".d.tmp").mkdir()  # being written: its entry stays
    record_save(tmp_path, "d", "run")
    record_save(tmp_path, "a", "other")  # a name taken again: it counts at its last save
    assert read_saves(tmp_path) == [("c", "run"), ("d", "run"), ("a", "other")]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [SAVES_FILE]  # no temporary file left


@pytest.mark.parametrize("text", [
    "not json", '{"format": "other", "saves": []}', "[" * 5000 + "]" * 5000, '{"format": "fittrain-saves"}',
])
def test_a_damaged_saves_json_lists_nothing_and_never_raises(tmp_path, text):
    (tmp_path / SAVES_FILE).write_text(text)
    (tmp_path / "checkpoint_1").mkdir()
    assert read_saves(tmp_path) == []
    assert _names(saved_in_order(tmp_path)) == ["checkpoint_1"]


def test_names_that_are_not_one_plain_folder_are_left_out_of_saves_json(tmp_path):
    saves = [{"name": name, "run": "r"} for name in ("../up", ".hidden", "a/b", "", 3, "ok")]
    (tmp_path / SAVES_FILE).write_text(json.dumps({"format": "fittrain-saves", "version": 1, "saves": saves}))
    assert read_saves(tmp_path) == [("ok", "r")]


def test_reserve_named_takes_the_first_free_candidate(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model-v1").write_text("a file counts as taken")
    held = TempFolder.claim(tmp_path / ".model-v2.tmp")  # a live writer (this process) holds v2
    reserved = reserve_named(tmp_path, ["model", "model-v1", "model-v2", "model-v3"])
    assert reserved_name(reserved) == "model-v3"
    reserved.release()
    held.release()
    with pytest.raises(ValueError, match=r"one plain folder name.*Received: '\.\./model'"):
        reserve_named(tmp_path, ["../model"])


def test_prune_deletes_only_this_runs_oldest_saves_and_never_what_a_link_leads_to(tmp_path):
    config = ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    config.use_run("mine")
    config.use_folder(tmp_path / "shared")
    folder = tmp_path / "shared"
    for name, run in (("other-0", "other"), ("mine-0", "mine"), ("mine-1", "mine"), ("mine-2", "mine")):
        _checkpoint(folder / name)
        record_save(folder, name, run)
    _checkpoint(folder / "unlisted")  # nobody's, as far as saves.json knows
    os.symlink("mine-1", folder / "last")
    config.prune()
    assert sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink()) == [
        "mine-1", "mine-2", "other-0", "unlisted"]


def test_delete_checkpoints_touches_only_checkpoints(tmp_path):
    _checkpoint(tmp_path / "epoch=1")
    (tmp_path / "mine").mkdir()  # a user's folder: no manifest
    (tmp_path / "notes").write_text("x")
    os.symlink("epoch=1", tmp_path / "last")
    delete_checkpoints(tmp_path, ["mine", "notes", "last", "gone"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1", "last", "mine", "notes"]
    delete_checkpoints(tmp_path, ["epoch=1"])
    assert not (tmp_path / "epoch=1").exists()
    with pytest.raises(ValueError, match=r"Received: '\.\./x'"):
        delete_checkpoints(tmp_path, ["../x"])


def test_point_link_replaces_the_link_and_never_what_is_not_a_checkpoint(tmp_path):
    _checkpoint(tmp_path / "a")
    _checkpoint(tmp_path / "b")
    point_link(tmp_path, "last", "a")
    point_link(tmp_path, "last", "b")
    assert os.readlink(tmp_path / "last") == "b" and is_intact(tmp_path / "last")
    assert link_targets(tmp_path) == {"b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "last"]  # no temporary link left
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError, match=r"neither a link nor a checkpoint"):
        point_link(tmp_path, "mine", "b")
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "mine").is_symlink()
