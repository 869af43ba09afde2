"""Checkpointer(save_last=True): `last` leads to the newest save after every save, is never missing,
dangling or half a checkpoint at any moment a crash could hit (checked by inspecting the folder at
every rename and deletion, and by crashing at the link's swap), is never deleted by total_limit or
save_top_k, moves with a templated name, leaves another run's `last` alone, and is a complete copy
where links cannot be made. Real Trainer runs on the CPU into real folders.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import torch

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import is_intact, naming
from fittrain.checkpoint import run_folders as run_folders_module


def _fit(make_module: Any, make_loader: Any, project: pathlib.Path, checkpointer: Checkpointer,
         *extra: Callback, **trainer_args: Any) -> Trainer:
    trainer_args.setdefault("max_epochs", 3)
    trainer = Trainer(project_dir=project, callbacks=[checkpointer, *extra], enable_progress_bar=False,
                      **trainer_args)
    trainer.fit(make_module(), make_loader(), make_loader())
    return trainer


def _target(link: pathlib.Path) -> str:
    return os.readlink(link)


class LinkAtSaves(Callback):
    """After the Checkpointer (next in the list), records where `last` leads after each of its saves."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer, self.seen, self._saved = checkpointer, [], None

    def on_train_batch_end(self, trainer: Trainer) -> None:
        saved = self.checkpointer.last_checkpoint
        if saved != self._saved:
            self._saved = saved
            link = pathlib.Path(self.checkpointer.last_model_path)
            self.seen.append((pathlib.Path(saved).name, _target(link), is_intact(link)))


def test_last_leads_to_the_newest_save_after_every_save(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_steps=2, dirpath=tmp_path / "ckpt", filename="{step}", save_last=True)
    watch = LinkAtSaves(checkpointer)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer, watch)
    assert watch.seen == [(f"step={s}", f"step={s}", True) for s in (2, 4, 6, 8, 10, 12)]
    last = tmp_path / "ckpt" / "last"
    assert last.is_symlink() and not os.path.isabs(os.readlink(last))  # relative: the folder may move
    assert checkpointer.last_model_path == str(last)


@pytest.fixture
def inspected(monkeypatch):
    """Checks the folder at every moment that matters: before and after each deletion of a checkpoint and
    each swap of the link, `last` must lead to an intact checkpoint, never to the folder being deleted."""
    moments: list[str] = []

    def check(last: pathlib.Path, when: str) -> None:
        if os.path.lexists(last):
            assert is_intact(last), f"{when}: {last} leads to {os.readlink(last)}, not an intact checkpoint"
            moments.append(when)

    original_delete = naming._delete_checkpoint

    def delete(folder: pathlib.Path) -> None:
        last = folder.parent / "last"
        check(last, f"before deleting {folder.name}")
        leads_there = os.path.lexists(last) and os.readlink(last) == folder.name
        assert not leads_there, f"deleting {folder.name}, which last leads to"
        original_delete(folder)
        check(last, f"after deleting {folder.name}")

    original_replace = os.replace

    def replace(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        swaps_link = str(source).endswith(".link")
        if swaps_link:
            check(pathlib.Path(target), "before the swap")
        original_replace(source, target, *args, **kwargs)
        if swaps_link:
            check(pathlib.Path(target), "after the swap")

    monkeypatch.setattr(naming, "_delete_checkpoint", delete)
    monkeypatch.setattr(run_folders_module.os, "replace", replace)
    return moments


class ScriptedLoss(Callback):
    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_validation_end(self, trainer: Trainer) -> None:
        trainer.state.raw_metrics["val_loss"] = self.losses[trainer.state.epoch]


@pytest.mark.parametrize("retention", [{"total_limit": 1}, {"monitor": "val_loss", "save_top_k": 1}],
                         ids=["total_limit", "save_top_k"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_last_is_never_missing_or_dangling_while_folders_go(make_module, make_loader, tmp_path, inspected,
                                                            retention, async_save):
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{epoch}", save_last=True,
                                async_save=async_save, **retention)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer, ScriptedLoss([0.1, 0.3, 0.2, 0.4]),
         max_epochs=4)
    assert any(moment.startswith("before deleting") for moment in inspected)
    assert any(moment == "before the swap" for moment in inspected)
    folder = tmp_path / "ckpt"
    assert _target(folder / "last") == "epoch=3"  # the newest, kept by both rules
    expected = ["epoch=3"] if "total_limit" in retention else ["epoch=0", "epoch=3"]
    assert sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink()) == expected


def test_a_crash_at_the_swap_leaves_last_at_the_previous_save(make_module, make_loader, tmp_path, monkeypatch):
    swaps, original = [], os.replace

    def crash_at_the_third_swap(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        if str(source).endswith(".link"):
            swaps.append(source)
            if len(swaps) == 3:
                raise RuntimeError("crash at the swap")
        original(source, target, *args, **kwargs)

    monkeypatch.setattr(run_folders_module.os, "replace", crash_at_the_third_swap)
    folder = tmp_path / "ckpt"

    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_steps=2, dirpath=folder, filename="{step}", save_last=True, total_limit=2)

    with pytest.raises(RuntimeError, match="crash at the swap"):
        _fit(make_module, make_loader, tmp_path / "project", checkpointer())
    # The third save (step 6) was committed, but last still leads to the second, intact and kept
    # (total_limit=2 kept it even without the link), and no temporary link is left behind.
    assert _target(folder / "last") == "step=4" and is_intact(folder / "last")
    assert sorted(p.name for p in folder.iterdir()) == ["last", "saves.json", "step=4", "step=6"]
    # A resume takes the newest save, not the one last leads to, and moves last on.
    monkeypatch.setattr(run_folders_module.os, "replace", original)
    trainer = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), resume_from="latest")
    assert trainer.state.global_step == 12
    assert _target(folder / "last") == "step=12"
    assert sorted(p.name for p in folder.iterdir() if not p.is_symlink()) == ["saves.json", "step=10", "step=12"]


def test_a_templated_last_moves_and_its_old_link_goes(make_module, make_loader, tmp_path):
    class EpochLast(Checkpointer):
        CHECKPOINT_NAME_LAST = "{epoch}-last"

    checkpointer = EpochLast(every_n_epochs=1, dirpath=tmp_path / "ckpt", save_last=True)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer)
    links = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_symlink())
    assert links == ["epoch=2-last"]
    assert _target(tmp_path / "ckpt" / "epoch=2-last") == "checkpoint_2"
    assert checkpointer.last_model_path == str(tmp_path / "ckpt" / "epoch=2-last")


def test_another_runs_last_is_left_alone_and_a_resumed_run_keeps_its_own(make_module, make_loader, tmp_path):
    folder = tmp_path / "ckpt"
    first = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
        every_n_epochs=1, dirpath=folder, filename="{epoch}", save_last=True), max_epochs=1)
    with pytest.warns(UserWarning, match="holds checkpoints already"):
        second = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
            every_n_epochs=1, dirpath=folder, filename="{epoch}", save_last=True), max_epochs=2)
    assert _target(folder / "last") == "epoch=0"  # the first run's
    assert _target(folder / "last-v1") == "epoch=1"  # the second run's: Lightning's version of "last"
    # Resumed from its own link, the second run goes on in its run and moves its own link.
    resumed = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
        every_n_epochs=1, dirpath=folder, filename="{epoch}", save_last=True), max_epochs=3,
        resume_from=folder / "last-v1")
    assert resumed.run_name == second.run_name != first.run_name
    assert _target(folder / "last") == "epoch=0"
    assert _target(folder / "last-v1") == "epoch=2"
    assert sorted(p.name for p in folder.iterdir() if p.is_symlink()) == ["last", "last-v1"]


def test_a_fit_that_saved_nothing_saves_last_when_training_ends(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_epochs=5, dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _fit(make_module, make_loader, tmp_path / "project", checkpointer, max_epochs=2)
    assert _target(tmp_path / "ckpt" / "last") == "checkpoint_0"
    assert is_intact(tmp_path / "ckpt" / "last")
    weights = trainer.module.state_dict()
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "last" / "model.safetensors")
    assert all(torch.equal(saved[k], weights[k]) for k in weights)  # the weights training ended with


def test_where_links_cannot_be_made_last_is_a_complete_copy(make_module, make_loader, tmp_path, monkeypatch):
    def no_links(*args: Any, **kwargs: Any) -> None:
        raise OSError(1, "Operation not permitted (no symlink privilege)")

    monkeypatch.setattr(run_folders_module.os, "symlink", no_links)
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", save_last=True, total_limit=1)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer)
    last, newest = tmp_path / "ckpt" / "last", tmp_path / "ckpt" / "checkpoint_2"
    assert last.is_dir() and not last.is_symlink() and is_intact(last)
    assert {p.name: p.read_bytes() for p in last.iterdir()} == {p.name: p.read_bytes() for p in newest.iterdir()}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == [
        "checkpoint_2", "last", "saves.json"]


def test_a_last_that_is_not_a_checkpoint_is_never_replaced(make_module, make_loader, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last").write_text("a user's file")
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", save_last=True)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer, max_epochs=1)
    assert (tmp_path / "ckpt" / "last").read_text() == "a user's file"
    assert _target(tmp_path / "ckpt" / "last-v1") == "checkpoint_0"
