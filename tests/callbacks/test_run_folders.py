"""One folder per run: `{project_dir}/checkpoints/{run_name}/checkpoint_{i}`.

Two fresh runs in one project_dir never touch each other's checkpoints (with total_limit=1 and
with save_top_k, the earlier run's files stay byte-identical); "latest" resumes the run started
last, in its own folder, ending bitwise equal to an uninterrupted run; a run folder is a valid
resume_from; a fresh fit never writes into a named run that holds checkpoints; the Logger's run
and the checkpoints' run carry one name. Real Trainer runs on the CPU into real folders.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from fittrain import Accelerator, Callback, ProjectConfiguration, Trainer
from fittrain.callbacks import Checkpointer, Logger
from fittrain.checkpoint import list_checkpoints
from fittrain.checkpoint.run_folders import RUN_FILE, read_start, record_run_start, run_folder, run_folders


def _files(folder: pathlib.Path) -> dict[str, bytes]:
    """Every file below `folder`, by relative path: what "untouched" is compared on."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _names(folder: pathlib.Path) -> list[str]:
    return [p.name for p in list_checkpoints(folder)]


def _fit(make_module, make_loader, project, checkpointer, **trainer_args):
    trainer_args.setdefault("max_epochs", 2)
    trainer = Trainer(project_dir=project, callbacks=[checkpointer], **trainer_args)
    module = make_module()
    trainer.fit(module, make_loader(), make_loader())
    return trainer, module


class ScriptedValLoss(Callback):
    """Overwrites val_loss after each validation with a scripted value per epoch, so the ranking is known."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_validation_end(self, trainer: Trainer) -> None:
        trainer.state.raw_metrics["val_loss"] = self.losses[trainer.state.epoch]


def _assert_bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_two_fresh_runs_with_total_limit_keep_their_own_folders(make_module, make_loader, tmp_path):
    first, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2, total_limit=1))
    first_dir = tmp_path / "checkpoints" / first.run_name
    assert _names(first_dir) == ["checkpoint_3"]
    before = _files(first_dir)

    second, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2, total_limit=1))

    assert second.run_name != first.run_name
    assert _files(first_dir) == before, "the second run changed the first run's folder"
    # The second run numbers its own saves from 0, and its total_limit pruned only its own.
    assert _names(tmp_path / "checkpoints" / second.run_name) == ["checkpoint_3"]
    assert [p.name for p in run_folders(tmp_path / "checkpoints")] == [second.run_name, first.run_name]
    assert not list_checkpoints(tmp_path / "checkpoints"), "nothing is saved in the flat layout"


def test_two_fresh_runs_with_save_top_k_keep_their_own_folders(make_module, make_loader, tmp_path):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_epochs=1, monitor="val_loss", save_top_k=1)

    trainer_args = {"max_epochs": 4}
    first = Trainer(project_dir=tmp_path, callbacks=[checkpointer(), ScriptedValLoss([0.1, 0.5, 0.4, 0.3])],
                    **trainer_args)
    first.fit(make_module(), make_loader(), make_loader())
    first_dir = tmp_path / "checkpoints" / first.run_name
    assert _names(first_dir) == ["checkpoint_0", "checkpoint_3"]  # the best, and the newest
    before = _files(first_dir)

    # The second run's saves are better than the first run's best: a shared ranking would delete it.
    second = Trainer(project_dir=tmp_path, callbacks=[checkpointer(), ScriptedValLoss([0.05, 0.04, 0.03, 0.02])],
                     **trainer_args)
    second.fit(make_module(), make_loader(), make_loader())

    assert _files(first_dir) == before
    second_dir = tmp_path / "checkpoints" / second.run_name
    assert _names(second_dir) == ["checkpoint_3"]
    assert second.best_checkpoint == second_dir / "checkpoint_3"
    assert first.best_checkpoint == first_dir / "checkpoint_0"


def test_latest_resumes_the_run_started_last_in_its_folder_exactly(make_module, make_loader, tmp_path):
    # An earlier, finished run: the uninterrupted reference.
    whole, whole_module = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2, total_limit=1))
    whole_dir = tmp_path / "checkpoints" / whole.run_name
    before = _files(whole_dir)
    # A newer run, interrupted after step 4 (checkpoint_0 and checkpoint_1)...
    cut, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), max_steps=4)
    cut_dir = tmp_path / "checkpoints" / cut.run_name
    assert _names(cut_dir) == ["checkpoint_0", "checkpoint_1"]

    # ...resumed with "latest": the newer run, in its folder, numbering on.
    resumed, resumed_module = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2),
                                   resume_from="latest")

    assert resumed.run_name == cut.run_name
    assert _names(cut_dir) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert _files(whole_dir) == before
    assert resumed.state.global_step == whole.state.global_step == 8
    _assert_bitwise_equal(resumed_module, whole_module)
    assert [p.name for p in run_folders(tmp_path / "checkpoints")] == [cut.run_name, whole.run_name]


def test_latest_follows_start_order_not_names_or_times(make_module, make_loader, tmp_path):
    older, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), run_name="zzz-older",
                    max_steps=4)
    newer, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), run_name="aaa-newer",
                    max_steps=4)
    # The older run's folder is touched last: a choice by mtime or by name would pick it.
    (tmp_path / "checkpoints" / "zzz-older" / "checkpoint_0" / "touched").mkdir()
    (tmp_path / "checkpoints" / "zzz-older" / "checkpoint_0" / "touched").rmdir()
    resumed, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), resume_from="latest",
                      max_steps=8)
    assert resumed.run_name == "aaa-newer"
    assert _names(tmp_path / "checkpoints" / "aaa-newer") == ["checkpoint_0", "checkpoint_1"]
    assert _names(tmp_path / "checkpoints" / "zzz-older") == ["checkpoint_0"]
    # Resuming a run makes it the one started last: "latest" follows the run that was last active.
    starts = {name: json.loads((tmp_path / "checkpoints" / name / RUN_FILE).read_text())["start"]
              for name in ("zzz-older", "aaa-newer")}
    assert starts["aaa-newer"] > starts["zzz-older"]
    assert run_folder(tmp_path) == tmp_path / "checkpoints" / "aaa-newer"


def test_latest_with_a_run_name_resumes_that_run(make_module, make_loader, tmp_path):
    _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), run_name="a", max_steps=4)
    _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), run_name="b", max_steps=4)
    resumed, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4), run_name="a",
                      resume_from="latest", max_steps=8)
    assert resumed.run_name == "a"
    assert _names(tmp_path / "checkpoints" / "a") == ["checkpoint_0", "checkpoint_1"]
    assert _names(tmp_path / "checkpoints" / "b") == ["checkpoint_0"]


def test_a_run_folder_resumes_from_its_newest_checkpoint(make_module, make_loader, tmp_path):
    cut, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), max_steps=4)
    resumed, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), max_steps=6,
                      resume_from=f"checkpoints/{cut.run_name}")
    assert resumed.run_name == cut.run_name
    assert _names(tmp_path / "checkpoints" / cut.run_name) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]


def test_a_checkpoint_from_elsewhere_starts_a_new_run_numbered_from_0(make_module, make_loader, tmp_path):
    source, _ = _fit(make_module, make_loader, tmp_path / "pretrain", Checkpointer(every_n_steps=2), max_steps=4)
    source_dir = tmp_path / "pretrain" / "checkpoints" / source.run_name
    before = _files(source_dir)
    tuned, _ = _fit(make_module, make_loader, tmp_path / "finetune", Checkpointer(every_n_steps=2), max_steps=6,
                    resume_from=source_dir / "checkpoint_1")
    assert tuned.state.global_step == 6
    assert _names(tmp_path / "finetune" / "checkpoints" / tuned.run_name) == ["checkpoint_0"]
    assert _files(source_dir) == before


def test_a_fresh_fit_refuses_a_named_run_that_holds_checkpoints(make_module, make_loader, tmp_path):
    _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), run_name="base", max_steps=2)
    before = _files(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"`Trainer\(run_name=\.\.\.\)` names a run whose checkpoints exist "
                                         r"already .*Received: run_name='base'.*resume_from='latest'"):
        _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), run_name="base", max_steps=2)
    with pytest.raises(ValueError, match=r"`Logger\(run_name=\.\.\.\)` names a run whose checkpoints"):
        Trainer(project_dir=tmp_path, callbacks=[Checkpointer(every_n_steps=2), Logger(run_name="base")],
                max_steps=2).fit(make_module(), make_loader())
    assert _files(tmp_path / "checkpoints") == before


def test_logs_and_checkpoints_share_the_run_name(make_module, make_loader, tmp_path):
    logger = Logger(log_with="csv", progress_bar=False)
    first = Trainer(project_dir=tmp_path, max_steps=4, callbacks=[Checkpointer(every_n_steps=2), logger])
    first.fit(make_module(), make_loader())
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [first.run_name]
    assert (tmp_path / "checkpoints" / first.run_name / "checkpoint_1").is_dir()
    # A logs folder of that name alone (no checkpoints) is taken too: the next fresh name differs.
    second = Trainer(project_dir=tmp_path, max_steps=2, callbacks=[Logger(log_with="csv", progress_bar=False)])
    second.fit(make_module(), make_loader())
    assert second.run_name != first.run_name
    resumed = Trainer(project_dir=tmp_path, max_steps=6, resume_from=f"checkpoints/{first.run_name}",
                      callbacks=[Checkpointer(every_n_steps=2), Logger(log_with="csv", progress_bar=False)])
    resumed.fit(make_module(), make_loader())
    assert resumed.run_name == first.run_name
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted([first.run_name, second.run_name])


def test_two_run_names_that_differ_are_refused(make_module, make_loader, tmp_path):
    trainer = Trainer(project_dir=tmp_path, run_name="a", callbacks=[Logger(run_name="b", progress_bar=False)])
    with pytest.raises(ValueError, match=r"The run is named twice, differently: Trainer\(run_name='a'\), "
                                         r"Logger\(run_name='b'\)"):
        trainer.fit(make_module(), make_loader())


@pytest.mark.parametrize("value", ["", "a b", "../up", 3])
def test_trainer_run_name_is_checked(value):
    with pytest.raises(ValueError, match=r"`Trainer\(run_name=\.\.\.\)` must be None or a name"):
        Trainer(run_name=value)


def test_a_plain_accelerator_keeps_the_flat_layout(tmp_path):
    acc = Accelerator(project_config=ProjectConfiguration(tmp_path, automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(2, 2))
    acc.save_state()
    acc.save_state()
    assert _names(tmp_path / "checkpoints") == ["checkpoint_0", "checkpoint_1"]
    assert not run_folders(tmp_path / "checkpoints")
    assert model is not None


@pytest.mark.parametrize("value", [True, False])
def test_project_configuration_refuses_a_bool_total_limit(value):
    with pytest.raises(ValueError, match=rf"`ProjectConfiguration\(total_limit=\.\.\.\)` must be a positive int .*"
                                         rf"Received: total_limit={value}\. Pass e\.g\. total_limit=3"):
        ProjectConfiguration(total_limit=value)


def test_a_damaged_run_file_ranks_its_run_last_and_never_raises(tmp_path):
    root = tmp_path / "checkpoints"
    for name, text in [("nested", "[" * 5000 + "]" * 5000), ("huge", " " * 10_000 + "{}"), ("garbled", "\xff{"),
                       ("wrong", '{"start": "7"}')]:
        (root / name).mkdir(parents=True)
        (root / name / RUN_FILE).write_text(text, encoding="latin-1")
    record_run_start(root / "first")
    record_run_start(root / "second")
    assert [read_start(root / name) for name in ("nested", "huge", "garbled", "wrong", "first", "second")] == [
        -1, -1, -1, -1, 0, 1]
    assert [p.name for p in run_folders(root)][:2] == ["second", "first"]


def test_auto_starts_fresh_then_resumes_like_latest(make_module, make_loader, tmp_path, capsys):
    """resume_from="auto": one command for a job's first launch (nothing saved: a new run, said in one
    line) and its requeue (the newest checkpoint, as "latest"), ending equal to an uninterrupted run."""
    whole, whole_module = _fit(make_module, make_loader, tmp_path / "whole", Checkpointer(every_n_steps=2))
    first, _ = _fit(make_module, make_loader, tmp_path / "job", Checkpointer(every_n_steps=2), max_steps=4,
                    resume_from="auto")
    assert first.state.global_step == 4
    out = capsys.readouterr().out
    assert f"resume_from='auto': nothing saved under {str(tmp_path / 'job' / 'checkpoints')!r} yet" in out, out
    assert "Resumed from" not in out

    requeued, requeued_module = _fit(make_module, make_loader, tmp_path / "job", Checkpointer(every_n_steps=2),
                                     resume_from="auto")
    job_dir = tmp_path / "job" / "checkpoints" / first.run_name
    assert f"Resumed from {job_dir / 'checkpoint_1'}" in capsys.readouterr().out
    assert requeued.run_name == first.run_name
    assert _names(job_dir) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert requeued.state.global_step == whole.state.global_step == 8
    _assert_bitwise_equal(requeued_module, whole_module)


def test_auto_starts_fresh_over_a_run_that_saved_nothing(make_module, make_loader, tmp_path, capsys):
    """A first launch that died before its first save leaves a run folder without checkpoints: "auto"
    starts afresh there, where "latest" has nothing to resume."""
    _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=100), max_steps=2)  # saves nothing
    assert len(run_folders(tmp_path / "checkpoints")) == 1
    with pytest.raises(FileNotFoundError, match="holds a complete checkpoint"):
        _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=100), resume_from="latest")
    fresh, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=100), max_steps=2,
                    resume_from="auto")
    assert fresh.state.global_step == 2 and "nothing saved under" in capsys.readouterr().out


def test_auto_refuses_to_start_afresh_over_damaged_checkpoints(make_module, make_loader, tmp_path):
    first, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2, total_limit=1), max_steps=2)
    (saved,) = list_checkpoints(tmp_path / "checkpoints" / first.run_name)
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated: fails its manifest size
    with pytest.warns(UserWarning, match="damaged"), \
            pytest.raises(FileNotFoundError, match="resume_from='auto' found checkpoints under .* none that can be"):
        _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2), resume_from="auto")
