"""Checkpointer: folder names and numbering, triggers, total_limit, safetensors contents, resume,
and async_save (background writes waited for at the end of fit and on an exception)."""

from __future__ import annotations

import pathlib
import time

import pytest
import torch
from safetensors.torch import load_file

from fittrain import Accelerator, Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import snapshot as snapshot_module
from fittrain.checkpoint.run_folders import run_folder, run_folders


class WeightHistory(Callback):
    """Copies the module's weights after every optimizer step, keyed by global_step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Trainer) -> None:
        state = trainer.module.state_dict()
        self.by_step[trainer.state.global_step] = {k: v.detach().clone() for k, v in state.items()}


def _run(project: pathlib.Path) -> pathlib.Path:
    """The checkpoint folder of the project's (latest started) run."""
    return run_folder(project)


def _names(project: pathlib.Path) -> list[str]:
    if not run_folders(project / "checkpoints"):
        return []
    folder = _run(project)
    names = [p.name for p in folder.iterdir() if p.name.startswith("checkpoint_")]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def _fit(make_module, make_loader, project, checkpointer, max_epochs=2, accumulation=1, resume_from=None):
    history = WeightHistory()
    trainer = Trainer(project_dir=project, max_epochs=max_epochs, gradient_accumulation_steps=accumulation,
                      resume_from=resume_from, callbacks=[history, checkpointer])
    module = make_module()
    trainer.fit(module, make_loader(), make_loader())
    return module, history


def _load_fresh(make_module, project: pathlib.Path, i: int) -> torch.nn.Module:
    """Loads checkpoint_i's model.safetensors into a new module with safetensors alone, strictly."""
    fresh = make_module()
    fresh.load_state_dict(load_file(_run(project) / f"checkpoint_{i}" / "model.safetensors"), strict=True)
    return fresh


def _assert_same_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    actual = module.state_dict()
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0)


def test_every_n_steps_numbers_folders_by_save(make_module, make_loader, tmp_path):
    module, history = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2))
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    # 2 epochs x 4 batches = 8 steps; checkpoint_i holds the weights right after step 2(i+1).
    for i, step in enumerate([2, 4, 6, 8]):
        _assert_same_weights(_load_fresh(make_module, tmp_path, i), history.by_step[step])
    _assert_same_weights(_load_fresh(make_module, tmp_path, 3), module.state_dict())


def test_every_n_steps_counts_optimizer_steps_not_batches(make_module, make_loader, tmp_path):
    # 8 batches with accumulation 2 are 4 optimizer steps: one save each, never one per batch.
    _, history = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=1), accumulation=2)
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    _assert_same_weights(_load_fresh(make_module, tmp_path, 1), history.by_step[2])


def test_total_limit_keeps_the_newest(make_module, make_loader, tmp_path):
    module, _ = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2, total_limit=2))
    assert _names(tmp_path) == ["checkpoint_2", "checkpoint_3"]
    _assert_same_weights(_load_fresh(make_module, tmp_path, 3), module.state_dict())


def test_every_n_epochs(make_module, make_loader, tmp_path):
    _, history = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_epochs=2), max_epochs=5)
    # Epochs 2 and 4 (counting from 1) end at steps 8 and 16; epoch 5 is not a multiple of 2.
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    _assert_same_weights(_load_fresh(make_module, tmp_path, 0), history.by_step[8])
    _assert_same_weights(_load_fresh(make_module, tmp_path, 1), history.by_step[16])


def test_both_triggers_on_one_step_save_once(make_module, make_loader, tmp_path):
    # Steps 4 and 8 end epochs too: each is saved once, not twice.
    _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4, every_n_epochs=1))
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    # checkpoint_0 was taken at the last batch of epoch 0, before that epoch ended. Resumed from it,
    # epoch 0 ends again at step 4; the Checkpointer's saved state knows step 4 is already saved.
    _, resumed = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=4, every_n_epochs=1),
                      resume_from=_run(tmp_path) / "checkpoint_0")
    assert _names(tmp_path) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    _assert_same_weights(_load_fresh(make_module, tmp_path, 2), resumed.by_step[8])


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("resume_from, max_epochs, resumed_step", [
    ("checkpoint_1", 2, 4),   # an older checkpoint of the run: 2 and 3 exist and must survive
    ("latest", 3, 8),
])
def test_resume_continues_numbering_without_overwriting(make_module, make_loader, tmp_path, resume_from, max_epochs,
                                                        resumed_step):
    _, first = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2))
    before = {name: _snapshot(_run(tmp_path) / name) for name in _names(tmp_path)}
    if resume_from != "latest":
        resume_from = _run(tmp_path) / resume_from

    module, second = _fit(make_module, make_loader, tmp_path, Checkpointer(every_n_steps=2),
                          max_epochs=max_epochs, resume_from=resume_from)

    assert min(second.by_step) == resumed_step + 1, "the second fit continued after the checkpoint's step"
    # Two new saves in the run's folder, numbered after its newest; the resumed step is not saved again.
    assert _names(tmp_path) == [f"checkpoint_{i}" for i in range(6)]
    assert {name: _snapshot(_run(tmp_path) / name) for name in before} == before
    for i, step in [(4, resumed_step + 2), (5, resumed_step + 4)]:
        _assert_same_weights(_load_fresh(make_module, tmp_path, i), second.by_step[step])
    if resume_from != "latest":  # the resumed run retraces the first one exactly
        _assert_same_weights(_load_fresh(make_module, tmp_path, 4), first.by_step[6])


def test_user_accelerator_gets_automatic_naming(make_module, make_loader, tmp_path):
    # An Accelerator built without a ProjectConfiguration cannot name checkpoints by itself.
    accelerator = Accelerator()
    trainer = Trainer(project_dir=tmp_path, max_epochs=2, accelerator=accelerator,
                      callbacks=[Checkpointer(every_n_epochs=1, total_limit=1)])
    trainer.fit(make_module(), make_loader())
    assert _names(tmp_path) == ["checkpoint_1"]
    assert accelerator.project_configuration.automatic_checkpoint_naming
    assert trainer.callbacks[0].last_checkpoint == str(tmp_path / "checkpoints" / trainer.run_name / "checkpoint_1")


@pytest.mark.parametrize("kwargs, received", [
    ({}, "every_n_steps=None, every_n_epochs=None"),
    ({"every_n_steps": -1}, "every_n_steps=-1"),
    ({"every_n_steps": 0}, "every_n_steps=0"),
    ({"every_n_epochs": 1.5}, "every_n_epochs=1.5"),
    ({"every_n_epochs": True}, "every_n_epochs=True"),
    ({"every_n_steps": 2, "total_limit": 0}, "total_limit=0"),
])
def test_bad_arguments(kwargs, received):
    with pytest.raises(ValueError, match=f"Received: {received}"):
        Checkpointer(**kwargs)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_save_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"async_save={value!r} \(type {type(value).__name__}\)"):
        Checkpointer(every_n_steps=1, async_save=value)


def test_repr_shows_every_argument():
    assert repr(Checkpointer(every_n_steps=2, total_limit=3, async_save=True)) == (
        "Checkpointer(every_n_steps=2, every_n_epochs=None, total_limit=3, async_save=True)")


@pytest.fixture
def slow_writes(monkeypatch):
    """Every checkpoint write sleeps before its first file, so a background write is still in flight
    when training goes on."""
    original = snapshot_module.write_snapshot

    def slow(writer, snapshot):
        time.sleep(0.2)
        original(writer, snapshot)

    monkeypatch.setattr(snapshot_module, "write_snapshot", slow)


def test_async_save_checkpoints_hold_the_weights_of_their_step(make_module, make_loader, tmp_path, slow_writes):
    checkpointer = Checkpointer(every_n_steps=2, total_limit=3, async_save=True)
    module, history = _fit(make_module, make_loader, tmp_path, checkpointer)
    # fit returned, so on_fit_end waited for the last write: every folder is there, the oldest pruned.
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert not [p for p in _run(tmp_path).iterdir() if p.name.startswith(".")]
    for i, step in [(1, 4), (2, 6), (3, 8)]:
        _assert_same_weights(_load_fresh(make_module, tmp_path, i), history.by_step[step])
    assert checkpointer.last_checkpoint == str(_run(tmp_path) / "checkpoint_3")


class FailAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise RuntimeError(f"boom at step {self.step}")


def test_an_exception_waits_for_the_write_in_flight(make_module, make_loader, tmp_path, slow_writes):
    # Saves at step 2 (on_train_batch_end), then the next callback raises in the same event.
    trainer = Trainer(project_dir=tmp_path, max_epochs=2,
                      callbacks=[Checkpointer(every_n_steps=2, async_save=True), FailAtStep(2)])
    with pytest.raises(RuntimeError, match="boom at step 2"):
        trainer.fit(make_module(), make_loader())
    assert _names(tmp_path) == ["checkpoint_0"]  # complete before the error left fit


def test_a_failed_write_is_noted_on_the_original_exception(make_module, make_loader, tmp_path, monkeypatch):
    def failing(writer, snapshot):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module, "write_snapshot", failing)
    trainer = Trainer(project_dir=tmp_path, max_epochs=2,
                      callbacks=[Checkpointer(every_n_steps=2, async_save=True), FailAtStep(2)])
    with pytest.raises(RuntimeError, match="boom at step 2") as caught:
        trainer.fit(make_module(), make_loader())
    notes = "\n".join(caught.value.__notes__)
    assert "Checkpointer" in notes and "No space left on device" in notes
    assert _names(tmp_path) == []
