"""Checkpointer(monitor=..., mode=..., save_top_k=..., restore_best=...): which folders stay on disk
(the top k plus the newest), trainer.best_checkpoint / best_score, a ranking that survives a resume,
restored best weights, and the errors for a missing metric and bad arguments.

Real Trainer runs on the CPU into real folders. The modules' validation returns, next to the real
`val_loss`, a `score` scripted by optimizer step or by epoch, so each test knows which save is best.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fittrain import Accelerator, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, EarlyStop
from fittrain.checkpoint import CheckpointError, ProjectConfiguration
from fittrain.checkpoint.run_folders import run_folder, run_folders

# By optimizer step, for saves every 2 steps of 3 epochs x 4 batches (steps 2..12 -> checkpoint_0..5).
STEP_SCORES = {2: 0.5, 4: 0.2, 6: 0.9, 8: 0.1, 10: 0.7, 12: 0.6}


class Scored(TrainModule):
    """A linear regression whose validation also returns `score`, looked up by step or epoch."""

    def __init__(self, scores: dict[int, float] | list[float], by: str = "step") -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.scores, self.by = scores, by

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        score = self.scores[self.global_step if self.by == "step" else self.current_epoch]
        return {"val_loss": nn.functional.mse_loss(self.net(x), y), "score": torch.tensor(score)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _names(project: pathlib.Path) -> list[str]:
    """The checkpoint folders of the project's (latest started) run."""
    if not run_folders(project / "checkpoints"):
        return []
    names = [p.name for p in run_folder(project).iterdir() if p.name.startswith("checkpoint_")]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def _fit(make_loader: Callable[..., Any], project: pathlib.Path, checkpointer: Checkpointer,
         scores: Any = STEP_SCORES, by: str = "step", extra_callbacks: tuple = (),
         **trainer_args: Any) -> tuple[Trainer, Scored]:
    """Fits a fresh Scored module (same initial weights every time) on 16 samples in batches of 4."""
    if by == "step":
        trainer_args.setdefault("val_every_n_steps", 2)
    trainer_args.setdefault("max_epochs", 3)
    trainer = Trainer(project_dir=project, callbacks=[checkpointer, *extra_callbacks], **trainer_args)
    torch.manual_seed(0)
    module = Scored(scores, by)
    trainer.fit(module, make_loader(), make_loader())
    return trainer, module


def test_top_k_keeps_the_best_and_the_newest_with_step_validation(make_loader, tmp_path):
    trainer, _ = _fit(make_loader, tmp_path, Checkpointer(every_n_steps=2, monitor="score", save_top_k=2))
    # Scores 0.5 0.2 0.9 0.1 0.7 0.6: the best two are checkpoint_3 and _1; checkpoint_5 is the newest.
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_3", "checkpoint_5"]
    assert trainer.best_checkpoint == tmp_path / "checkpoints" / trainer.run_name / "checkpoint_3"
    assert isinstance(trainer.best_checkpoint, pathlib.Path)
    assert trainer.best_score == pytest.approx(0.1)


def test_mode_max_with_epoch_saves(make_loader, tmp_path):
    scores = [0.3, 0.9, 0.1, 0.5, 0.2]
    checkpointer = Checkpointer(every_n_epochs=1, monitor="score", mode="max", save_top_k=2)
    trainer, _ = _fit(make_loader, tmp_path, checkpointer, scores, by="epoch", max_epochs=5)
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_3", "checkpoint_4"]
    assert trainer.best_checkpoint.name == "checkpoint_1"
    assert trainer.best_score == pytest.approx(0.9)


def test_nan_and_inf_rank_below_every_finite_score(make_loader, tmp_path):
    scores = [0.2, math.inf, math.nan, 0.5, 0.1]  # in "max" mode inf would otherwise win
    checkpointer = Checkpointer(every_n_epochs=1, monitor="score", mode="max", save_top_k=1)
    trainer, _ = _fit(make_loader, tmp_path, checkpointer, scores, by="epoch", max_epochs=5)
    assert _names(tmp_path) == ["checkpoint_3", "checkpoint_4"]
    assert trainer.best_score == pytest.approx(0.5)
    # The ranking in the state is JSON-safe even while it held NaN and infinity.
    json.dumps(trainer.callbacks[0].state_dict(), allow_nan=False)


def test_monitor_without_save_top_k_keeps_every_checkpoint(make_loader, tmp_path):
    trainer, _ = _fit(make_loader, tmp_path, Checkpointer(every_n_steps=2, monitor="score"))
    assert _names(tmp_path) == [f"checkpoint_{i}" for i in range(6)]
    assert trainer.best_checkpoint.name == "checkpoint_3"


def test_async_save_deletes_the_same_folders_once_saves_are_committed(make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_steps=2, monitor="score", save_top_k=2, async_save=True)
    trainer, _ = _fit(make_loader, tmp_path, checkpointer)
    assert _names(tmp_path) == ["checkpoint_1", "checkpoint_3", "checkpoint_5"]
    assert trainer.best_checkpoint.name == "checkpoint_3"


@pytest.mark.parametrize("monitor", ["score", "val_loss"])
def test_an_interrupted_run_keeps_its_ranking_and_ends_like_an_uninterrupted_one(make_loader, tmp_path, monitor):
    def checkpointer() -> Checkpointer:
        return Checkpointer(every_n_steps=2, monitor=monitor, save_top_k=2)

    whole, _ = _fit(make_loader, tmp_path / "whole", checkpointer())
    # Stopped after step 6 (checkpoint_2, the newest, ranked worst by score): only the ranking that
    # checkpoint_2 holds tells the resumed run to delete it and checkpoint_0 after step 8. With the
    # real val_loss, the scores themselves must come out of the resume exactly.
    _fit(make_loader, tmp_path / "parts", checkpointer(), max_steps=6)
    if monitor == "score":
        assert _names(tmp_path / "parts") == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    resumed, _ = _fit(make_loader, tmp_path / "parts", checkpointer(), resume_from="latest")
    assert _names(tmp_path / "parts") == _names(tmp_path / "whole")
    assert resumed.best_checkpoint.name == whole.best_checkpoint.name
    assert resumed.best_score == whole.best_score
    assert resumed.callbacks[0].state_dict() == whole.callbacks[0].state_dict()
    if monitor == "score":
        assert _names(tmp_path / "parts") == ["checkpoint_1", "checkpoint_3", "checkpoint_5"]


def test_restore_best_loads_the_best_weights_into_the_module(make_loader, tmp_path):
    checkpointer = Checkpointer(every_n_steps=2, monitor="score", save_top_k=2, restore_best=True)
    trainer, module = _fit(make_loader, tmp_path, checkpointer)
    best = load_file(trainer.best_checkpoint / "model.safetensors")
    newest = load_file(run_folder(tmp_path) / "checkpoint_5" / "model.safetensors")
    assert not torch.equal(best["net.weight"], newest["net.weight"])  # restoring changes something
    assert module.state_dict().keys() == best.keys()
    for key, value in module.state_dict().items():
        assert torch.equal(value, best[key]), key


def test_a_monitor_that_never_appears_is_a_clear_error(make_loader, tmp_path):
    with pytest.raises(ValueError, match=r"monitor='val_acc'.*Metrics that exist: \[.*'score'.*'val_loss'"):
        _fit(make_loader, tmp_path, Checkpointer(every_n_steps=2, monitor="val_acc"))
    assert _names(tmp_path) == []  # refused before the first save


def test_a_save_before_the_first_validation_is_a_clear_error(make_loader, tmp_path):
    # Validation runs at epoch ends only, so the save after step 1 has no score to record.
    with pytest.raises(ValueError, match=r"optimizer step 1\. Received: monitor='val_loss'.*val_every_n_steps"):
        _fit(make_loader, tmp_path, Checkpointer(every_n_steps=1, monitor="val_loss"), by="epoch",
             scores=[0.0, 0.0, 0.0])


@pytest.mark.parametrize("kwargs,match", [
    ({"monitor": "score", "save_top_k": 0}, r"save_top_k=\.\.\.\)` must be a positive integer.*save_top_k=0\."),
    ({"monitor": "score", "save_top_k": -1}, r"save_top_k=-1\..*None to keep every"),
    ({"monitor": "score", "save_top_k": "3"}, r"save_top_k='3'"),
    ({"monitor": "score", "save_top_k": True}, r"save_top_k=True"),
    ({"monitor": "score", "mode": "sideways"},
     r"`Checkpointer\(mode=\.\.\.\)` must be 'min' or 'max'.*mode='sideways'"),
    ({"mode": "sideways"}, r"mode='sideways'"),
    ({"save_top_k": 2}, r"`Checkpointer\(save_top_k=2\)` needs monitor=.*Received: save_top_k=2, monitor=None"),
    ({"restore_best": True}, r"restore_best=True\)` needs monitor=.*monitor=None"),
    ({"monitor": ""}, r"monitor=''"),
    ({"monitor": 3}, r"monitor=3"),
    ({"monitor": "score", "save_top_k": 2, "total_limit": 3}, r"total_limit=3, monitor='score', save_top_k=2"),
])
def test_bad_arguments_are_refused_naming_the_argument_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Checkpointer(every_n_steps=1, **kwargs)


def test_restore_best_must_be_a_bool():
    with pytest.raises(TypeError, match=r"restore_best='yes' \(type str\)"):
        Checkpointer(every_n_steps=1, monitor="score", restore_best="yes")


def test_an_accelerator_total_limit_is_refused_with_monitor(make_loader, tmp_path):
    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), total_limit=2))
    with pytest.raises(ValueError, match=r"total_limit=2 in trainer\.accelerator\.project_configuration"):
        _fit(make_loader, tmp_path, Checkpointer(every_n_steps=2, monitor="score", save_top_k=1),
             accelerator=accelerator)


def test_a_damaged_ranking_is_refused_and_another_monitors_ranking_is_left_out():
    checkpointer = Checkpointer(every_n_steps=1, monitor="score", save_top_k=1)
    state = {"last_saved_step": 4, "monitor": "score", "mode": "min"}
    with pytest.raises(CheckpointError, match=r"\[0\.1, '\.\./elsewhere'\]"):
        checkpointer.load_state_dict({**state, "ranking": [[0.1, "../elsewhere"]]})
    with pytest.warns(UserWarning, match=r"monitor='val_acc', mode='max', not monitor='score', mode='min'"):
        checkpointer.load_state_dict({**state, "monitor": "val_acc", "mode": "max",
                                      "ranking": [[0.1, "checkpoint_0"]]})
    assert checkpointer.state_dict()["ranking"] == []


def test_repr_names_the_best_checkpoint_arguments():
    assert repr(Checkpointer(every_n_epochs=1, monitor="val_acc", mode="max", save_top_k=3, restore_best=True)) == (
        "Checkpointer(every_n_steps=None, every_n_epochs=1, total_limit=None, async_save=False, "
        "monitor='val_acc', mode='max', save_top_k=3, restore_best=True)")


@pytest.mark.parametrize("validation", [{"val_every_n_steps": 3}, {"val_every_n_epochs": 2}])
def test_each_epoch_save_holds_the_weights_its_score_was_measured_on(make_loader, tmp_path, validation):
    # Validation after steps 3, 6, 9 of 4-step epochs (or every other epoch): an epoch's end has trained past
    # its last validation (or had none), so the epoch's saves come right after its validations instead.
    checkpointer = Checkpointer(every_n_epochs=1, monitor="val_loss")
    trainer, module = _fit(make_loader, tmp_path, checkpointer, by="epoch", scores=[0.0] * 4, max_epochs=3,
                           **validation)
    trainer.validate(module, make_loader())  # outside fit: no save
    loader = make_loader()
    x, y = torch.cat([b[0] for b in loader]), torch.cat([b[1] for b in loader])
    expected_saves = 4 if "val_every_n_steps" in validation else 1  # steps 3, 6, 9, 12; epoch 2 of 3
    assert len(checkpointer.best_k_models) == expected_saves
    for path, score in checkpointer.best_k_models.items():
        weights = load_file(pathlib.Path(path) / "model.safetensors")
        val_loss = nn.functional.mse_loss(x @ weights["net.weight"].T + weights["net.bias"], y)
        assert score == pytest.approx(float(val_loss), rel=1e-5), f"{path} holds other weights than its score's"


def test_a_save_after_a_mid_epoch_validation_holds_every_callbacks_view_of_it(make_loader, tmp_path):
    # Listed before EarlyStop, the Checkpointer still saves after EarlyStop took the validation in: a run
    # resumed from the save of step 9 (no improvement: patience 1 of 2 used) stops where the run did.
    scores = {step: {3: 0.5, 6: 0.4}.get(step, 0.6 + 0.01 * step) for step in range(1, 25)}

    def fit(project: pathlib.Path, resume_from: Any = None) -> Trainer:
        callbacks = [Checkpointer(every_n_epochs=1, monitor="score"), EarlyStop(monitor="score", patience=2)]
        return _fit(make_loader, project, callbacks[0], scores, val_every_n_steps=3, max_epochs=6,
                    extra_callbacks=callbacks[1:], resume_from=resume_from)[0]

    whole = fit(tmp_path / "whole")
    assert whole.state.global_step == 12  # no improvement at steps 9 and 12
    assert _names(tmp_path / "whole") == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    resumed = fit(tmp_path / "whole", resume_from=run_folder(tmp_path / "whole") / "checkpoint_2")
    assert resumed.state.global_step == 12
