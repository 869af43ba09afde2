"""Checkpointer(dirpath=..., filename=...): names formatted as Lightning formats them (checked against
Lightning's own ModelCheckpoint), Lightning's -v1/-v2 versions, clear errors for unknown metrics and
unsafe names, resume by save order (never by name) ending bitwise equal to an uninterrupted run, and
a shared dirpath whose other files and other runs' checkpoints are never deleted.

Real Trainer runs on the CPU into real folders.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.callbacks.checkpoint_names import NameTemplate
from fittrain.checkpoint import is_intact
from fittrain.checkpoint.run_folders import SAVES_FILE, read_saves, saved_in_order


class ScriptedMetrics(Callback):
    """Sets metrics after each validation from per-epoch scripts, so names and rankings are known."""

    def __init__(self, **scripts: list[float]) -> None:
        self.scripts = scripts

    def on_validation_end(self, trainer: Trainer) -> None:
        for name, values in self.scripts.items():
            trainer.state.raw_metrics[name] = values[trainer.state.epoch]


def _shuffled(make_loader: Any) -> DataLoader:
    """The callbacks' data, shuffled: a resume is exact only if the sampler's RNG is restored."""
    return DataLoader(make_loader().dataset, batch_size=4, shuffle=True)


def _fit(make_module: Any, make_loader: Any, project: pathlib.Path, checkpointer: Checkpointer,
         *extra: Callback, seed: int = 0, **trainer_args: Any) -> tuple[Trainer, torch.nn.Module]:
    trainer_args.setdefault("max_epochs", 3 if "max_steps" not in trainer_args else None)
    trainer = Trainer(project_dir=project, callbacks=[checkpointer, *extra], enable_progress_bar=False,
                      **trainer_args)
    module = make_module()
    torch.manual_seed(seed)  # the loader's shuffling: a resumed run must get it from its checkpoint
    trainer.fit(module, _shuffled(make_loader), make_loader())
    return trainer, module


def _folders(folder: pathlib.Path) -> list[str]:
    """The checkpoint folders in `folder`, by name."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))


def _assert_bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("template, auto_insert", [
    ("{epoch}-{step}", True),
    ("{epoch}-{val_loss:.3f}", True),
    ("model-{epoch:02d}", True),
    ("{epoch}-{val_loss}-{val_loss_ema:.2f}", True),  # one name the prefix of another
    ("{val.acc:.1%}-{epoch}", True),
    ("e{epoch}-vl{val/loss:.2f}", False),
    ("weights", True),
])
def test_names_are_formatted_as_lightning_formats_them(template, auto_insert):
    from lightning.pytorch.callbacks import ModelCheckpoint  # test-only: Lightning's own formatting

    values = {"epoch": 7, "step": 120, "val_loss": 0.123456, "val_loss_ema": 0.5, "val.acc": 0.25, "val/loss": 1.5}
    theirs = ModelCheckpoint(filename=template, auto_insert_metric_name=auto_insert).format_checkpoint_name(
        dict(values))
    assert NameTemplate(template, auto_insert).format(values) == os.path.basename(theirs)[:-len(".ckpt")]


def test_a_fit_names_its_folders_by_the_template(make_module, make_loader, tmp_path):
    scripted = ScriptedMetrics(val_loss=[0.5, 0.25, 0.125])
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{epoch}-{step}-{val_loss:.3f}")
    trainer, _ = _fit(make_module, make_loader, tmp_path / "project", checkpointer, scripted)
    # 4 batches an epoch: epochs 0, 1, 2 end at steps 4, 8, 12.
    names = ["epoch=0-step=4-val_loss=0.500", "epoch=1-step=8-val_loss=0.250", "epoch=2-step=12-val_loss=0.125"]
    assert _folders(tmp_path / "ckpt") == names
    assert all(is_intact(tmp_path / "ckpt" / name) for name in names)
    assert [name for name, _ in read_saves(tmp_path / "ckpt")] == names
    assert {run for _, run in read_saves(tmp_path / "ckpt")} == {trainer.run_name}
    assert checkpointer.last_checkpoint == str(tmp_path / "ckpt" / names[-1])
    # Nothing is saved in the run's folder: dirpath replaces it.
    assert not (tmp_path / "project" / "checkpoints" / trainer.run_name).exists()


def test_a_name_that_exists_gets_lightnings_versions(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_steps=3, dirpath=tmp_path / "ckpt", filename="model")
    _fit(make_module, make_loader, tmp_path / "project", checkpointer, max_steps=12)
    assert _folders(tmp_path / "ckpt") == ["model", "model-v1", "model-v2", "model-v3"]
    # In save order, which their names do not give ("model-v10" would sort before "model-v2").
    assert [p.name for p in saved_in_order(tmp_path / "ckpt")] == ["model", "model-v1", "model-v2", "model-v3"]


def test_an_unknown_metric_is_a_clear_error_at_the_first_save(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{epoch}-{val_acc:.2f}")
    with pytest.raises(ValueError, match=r"`Checkpointer\(filename='\{epoch\}-\{val_acc:\.2f\}'\)` names 'val_acc'.*"
                                         r"optimizer step 4\. Metrics that exist: \[.*'train_loss'.*'val_loss'"):
        _fit(make_module, make_loader, tmp_path / "project", checkpointer)
    assert _folders(tmp_path / "ckpt") == []  # refused before anything was saved


def test_a_format_spec_that_does_not_fit_is_a_clear_error(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{val_loss:03d}")
    with pytest.raises(ValueError, match=r"cannot format \{'val_loss': .*\} at the save after optimizer step 4: "
                                         r"Unknown format code 'd'"):
        _fit(make_module, make_loader, tmp_path / "project", checkpointer)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"filename": "sub/{epoch}"}, ValueError, r"must make one folder name.*Received: filename='sub/\{epoch\}'"),
    ({"filename": ".hidden-{epoch}"}, ValueError, r"no leading '\.'"),
    ({"filename": "{epoch"}, ValueError, r"is not a valid template"),
    ({"filename": "{}"}, ValueError, r"no empty field"),
    ({"filename": "{epoch}-{val/loss:.2f}"}, ValueError,
     r"names the metric 'val/loss', and auto_insert_metric_name=True would write it into the folder name.*"
     r"auto_insert_metric_name=False"),
    ({"filename": 3}, TypeError, r"filename=3 \(type int\)"),
    ({"dirpath": 3}, TypeError, r"`dirpath` must be a str or os\.PathLike"),
    ({"dirpath": ""}, ValueError, r"dirpath=''"),
    ({"save_last": "yes"}, ValueError, r"save_last='yes'"),
    ({"auto_insert_metric_name": "no"}, ValueError, r"auto_insert_metric_name='no'"),
])
def test_bad_arguments_are_refused_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        Checkpointer(every_n_epochs=1, **kwargs)


def test_resume_picks_the_newest_save_not_the_greatest_name(make_module, make_loader, tmp_path):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_steps=2, dirpath=tmp_path / "ckpt", filename="{step}")

    _, whole = _fit(make_module, make_loader, tmp_path / "whole", Checkpointer(every_n_steps=2), max_steps=20)
    _fit(make_module, make_loader, tmp_path / "project", checkpointer(), max_steps=12)
    assert max(_folders(tmp_path / "ckpt")) == "step=8"  # the greatest name; "step=12" is the newest save
    for resume_from in ("latest", tmp_path / "ckpt"):  # both mean the newest save in dirpath
        trainer, _ = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), seed=999, max_steps=16,
                          resume_from=resume_from)
        # Resumed at step 12: its saves are steps 14 and 16. From "step=8" it would have saved
        # "step=10-v1" and "step=12-v1".
        assert _folders(tmp_path / "ckpt") == [f"step={s}" for s in (10, 12, 14, 16, 2, 4, 6, 8)]
        shutil.rmtree(tmp_path / "ckpt" / "step=14")
        shutil.rmtree(tmp_path / "ckpt" / "step=16")
    trainer, resumed = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), seed=999, max_steps=20,
                            resume_from="latest")
    assert trainer.state.global_step == 20
    _assert_bitwise_equal(resumed, whole)


def test_a_resumed_run_goes_on_with_its_versions_ranking_and_run(make_module, make_loader, tmp_path):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="best", monitor="val_loss",
                            save_top_k=1)

    losses = ScriptedMetrics(val_loss=[0.5, 0.1, 0.4, 0.3, 0.2])
    whole, whole_module = _fit(make_module, make_loader, tmp_path / "whole", checkpointer(), losses, max_epochs=5)
    # Saves "best" (0.5), "best-v1" (0.1: "best" goes), "best" (0.4: free again), "best-v2" (0.3: "best" goes),
    # "best" (0.2: "best-v2" goes): the top 1 plus the newest are kept.
    whole_names = _folders(tmp_path / "ckpt")
    assert whole_names == ["best", "best-v1"]
    whole_state = whole.callbacks[0].state_dict()
    shutil.rmtree(tmp_path / "ckpt")

    cut, _ = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), losses, max_epochs=3)
    resumed, module = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), losses, max_epochs=5,
                           seed=999, resume_from="latest")
    assert _folders(tmp_path / "ckpt") == whole_names
    assert resumed.run_name == cut.run_name  # the run that saved the checkpoint goes on, as saves.json says
    assert resumed.callbacks[0].state_dict() == whole_state
    assert resumed.callbacks[0].best_model_path == str(tmp_path / "ckpt" / "best-v1")
    assert resumed.best_checkpoint == tmp_path / "ckpt" / "best-v1"
    _assert_bitwise_equal(module, whole_module)


def test_latest_passes_over_a_damaged_newest_save_and_a_lost_index(make_module, make_loader, tmp_path):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_steps=2, dirpath=tmp_path / "ckpt", filename="{step}")

    _fit(make_module, make_loader, tmp_path / "project", checkpointer(), max_steps=12)
    weights = tmp_path / "ckpt" / "step=12" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    (tmp_path / "ckpt" / SAVES_FILE).unlink()  # then the step each checkpoint holds orders them
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*step=12"):
        trainer, _ = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), max_steps=12,
                          resume_from="latest")
    assert trainer.state.global_step == 12
    # Resumed from step=10 (the newest intact), it saved step 12 again, beside the damaged folder.
    assert _folders(tmp_path / "ckpt")[:3] == ["step=10", "step=12", "step=12-v1"]
    assert is_intact(tmp_path / "ckpt" / "step=12-v1")


def test_a_shared_dirpath_keeps_what_this_run_did_not_save(make_module, make_loader, tmp_path):
    folder = tmp_path / "ckpt"
    first, _ = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
        every_n_steps=2, dirpath=folder, filename="{step}"), max_steps=4)
    (folder / "notes.txt").write_text("mine")
    (folder / "mine").mkdir()
    before = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
              if p.is_file() and p.name != SAVES_FILE}
    with pytest.warns(UserWarning, match=r"holds checkpoints already"):
        second, _ = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
            every_n_steps=2, dirpath=folder, filename="{step}", total_limit=1), max_steps=8)
    assert {name: (folder / name).read_bytes() for name in before} == before, "it changed what it did not save"
    # Its own saves "step=2-v1" ... "step=8": total_limit=1 kept only its newest.
    assert _folders(folder) == ["mine", "step=2", "step=4", "step=8"]
    assert {run for name, run in read_saves(folder) if name == "step=8"} == {second.run_name}
    assert first.run_name != second.run_name


def test_save_top_k_in_a_dirpath_deletes_only_its_own_saves(make_module, make_loader, tmp_path):
    folder = tmp_path / "ckpt"
    _fit(make_module, make_loader, tmp_path / "other", Checkpointer(every_n_epochs=1, dirpath=folder,
                                                                     filename="{epoch}"), max_epochs=2)
    losses = ScriptedMetrics(val_loss=[0.3, 0.1, 0.2])
    with pytest.warns(UserWarning, match=r"holds checkpoints already"):
        trainer, _ = _fit(make_module, make_loader, tmp_path / "project", Checkpointer(
            every_n_epochs=1, dirpath=folder, filename="{epoch}", monitor="val_loss", save_top_k=1), losses)
    # The other run's epoch=0 and epoch=1 stay; this run's epoch=0-v1 (0.3) went, epoch=1-v1 (best) and
    # epoch=2 (newest) stay.
    assert _folders(folder) == ["epoch=0", "epoch=1", "epoch=1-v1", "epoch=2"]
    assert trainer.callbacks[0].best_model_path == str(folder / "epoch=1-v1")


def test_lightnings_attributes_follow_the_ranking(make_module, make_loader, tmp_path):
    losses = ScriptedMetrics(val_loss=[0.5, 0.2, 0.4, 0.3])
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{epoch}", monitor="val_loss",
                                save_top_k=2)
    assert (checkpointer.best_model_path, checkpointer.best_model_score, checkpointer.best_k_models) == ("", None, {})
    _fit(make_module, make_loader, tmp_path / "project", checkpointer, losses, max_epochs=4)
    path = {epoch: str(tmp_path / "ckpt" / f"epoch={epoch}") for epoch in range(4)}
    assert checkpointer.best_model_path == path[1]
    assert checkpointer.best_model_score == pytest.approx(0.2)
    assert checkpointer.best_k_models == {path[1]: pytest.approx(0.2), path[3]: pytest.approx(0.3)}
    assert checkpointer.kth_best_model_path == path[3]
    assert checkpointer.last_checkpoint == path[3]
    assert checkpointer.last_model_path == ""  # no save_last
    # Lightning's best without a monitor: the newest save.
    plain = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "plain")
    _fit(make_module, make_loader, tmp_path / "project", plain, max_epochs=2)
    assert plain.best_model_path == plain.last_checkpoint == str(tmp_path / "plain" / "checkpoint_1")
    assert (plain.best_model_score, plain.best_k_models, plain.kth_best_model_path) == (None, {}, "")


def test_a_template_named_checkpoint_loads_with_safetensors_alone(make_module, make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_epochs=1, filename="{epoch}-{step}")
    trainer, module = _fit(make_module, make_loader, tmp_path, checkpointer, max_epochs=1)
    folder = tmp_path / "checkpoints" / trainer.run_name / "epoch=0-step=4"
    fresh = make_module()
    fresh.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    _assert_bitwise_equal(fresh, module)
    assert json.loads((folder.parent / SAVES_FILE).read_text())["saves"][0]["name"] == "epoch=0-step=4"


def test_latest_in_a_run_folder_of_template_names_takes_the_newest_save(make_module, make_loader, tmp_path):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_steps=2, filename="{step}")

    _, whole = _fit(make_module, make_loader, tmp_path / "whole", Checkpointer(every_n_steps=2), max_steps=16)
    cut, _ = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), max_steps=12)
    run = tmp_path / "project" / "checkpoints" / cut.run_name
    for resume_from in ("latest", run):  # "latest", and the run's folder: both its newest save
        trainer, module = _fit(make_module, make_loader, tmp_path / "project", checkpointer(), seed=999,
                               max_steps=16, resume_from=resume_from)
        assert trainer.run_name == cut.run_name
        assert _folders(run) == [f"step={s}" for s in (10, 12, 14, 16, 2, 4, 6, 8)]  # no "-v1": resumed at 12
        _assert_bitwise_equal(module, whole)
        shutil.rmtree(run / "step=14")
        shutil.rmtree(run / "step=16")
