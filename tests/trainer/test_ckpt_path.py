"""Trainer.validate/test/predict(ckpt_path=...): "best" (the Checkpointer's best; without a monitor its
newest save, as in Lightning), "last" (its newest save), a checkpoint folder (or the `last` link), and
clear errors naming ckpt_path for everything else. The weights evaluated are compared with the saved
files, read with safetensors alone. Real Trainer runs on the CPU into real folders.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import CheckpointError
from support.models import Regressor, regression_loader


class ScriptedLoss(Callback):
    """Sets val_loss after each validation from a per-epoch script, so the best save is known."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def on_validation_end(self, trainer: Trainer) -> None:
        if trainer.state.epoch < len(self.losses):  # while fitting; not in validate() after it
            trainer.state.raw_metrics["val_loss"] = self.losses[trainer.state.epoch]


def _module() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def _fit(tmp_path: pathlib.Path, checkpointer: Checkpointer | None, *extra: Callback,
         max_epochs: int = 4) -> tuple[Trainer, Regressor]:
    callbacks = [checkpointer, *extra] if checkpointer is not None else list(extra)
    trainer = Trainer(project_dir=tmp_path, max_epochs=max_epochs, callbacks=callbacks, enable_progress_bar=False)
    module = _module()
    trainer.fit(module, regression_loader(), regression_loader())
    return trainer, module


def _data(method: str) -> Any:
    """The loader `method` takes: predict runs forward on the inputs alone."""
    return [x for x, _ in regression_loader()] if method == "predict" else regression_loader()


def _saved(folder: str | pathlib.Path) -> dict[str, torch.Tensor]:
    return load_file(pathlib.Path(folder) / "model.safetensors")


def _assert_weights(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    actual = module.state_dict()
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def _best_fit(tmp_path: pathlib.Path) -> tuple[Trainer, Regressor, Checkpointer]:
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", filename="{epoch}", monitor="val_loss",
                                save_top_k=2)
    trainer, module = _fit(tmp_path, checkpointer, ScriptedLoss([0.4, 0.1, 0.3, 0.2]))
    return trainer, module, checkpointer


@pytest.mark.parametrize("method", ["validate", "test", "predict"])
def test_best_evaluates_the_best_checkpoints_weights(tmp_path, method, capsys):
    trainer, module, checkpointer = _best_fit(tmp_path)
    best = tmp_path / "ckpt" / "epoch=1"
    assert checkpointer.best_model_path == str(best)
    newest = _saved(tmp_path / "ckpt" / "epoch=3")
    _assert_weights(module, newest)  # after fit the module holds the newest weights
    result = getattr(trainer, method)(module, _data(method), ckpt_path="best")
    _assert_weights(module, _saved(best))
    assert f"Trainer.{method}: restored the model's weights from {best} (ckpt_path='best')" in capsys.readouterr().out
    # What it evaluated is what a fresh module with the best weights gives.
    fresh = _module()
    fresh.load_state_dict(_saved(best))
    expected = getattr(Trainer(enable_progress_bar=False), method)(fresh, _data(method))
    if method == "predict":
        assert torch.equal(result, expected)
    else:
        assert result == expected


def test_last_evaluates_the_newest_save(tmp_path):
    trainer, module, _ = _best_fit(tmp_path)
    trainer.validate(module, regression_loader(), ckpt_path="best")
    trainer.test(module, regression_loader(), ckpt_path="last")
    _assert_weights(module, _saved(tmp_path / "ckpt" / "epoch=3"))


def test_best_without_a_monitor_is_the_newest_save_as_in_lightning(tmp_path):
    checkpointer = Checkpointer(every_n_epochs=2)
    trainer, module = _fit(tmp_path, checkpointer, max_epochs=3)  # saves after epochs 2 only: checkpoint_0
    newest = tmp_path / "checkpoints" / trainer.run_name / "checkpoint_0"
    assert checkpointer.best_model_path == checkpointer.last_checkpoint == str(newest)
    trainer.test(module, regression_loader(), ckpt_path="best")
    _assert_weights(module, _saved(newest))


def test_a_checkpoint_folder_or_the_last_link_on_a_fresh_trainer(tmp_path):
    _, _, _ = _best_fit(tmp_path / "fit")
    folder = tmp_path / "fit" / "ckpt" / "epoch=3"
    module = _module()
    Trainer(enable_progress_bar=False).validate(module, regression_loader(), ckpt_path=folder)
    _assert_weights(module, _saved(folder))
    # Relative to the Trainer's project_dir, as resume_from is.
    module = _module()
    Trainer(project_dir=tmp_path / "fit", enable_progress_bar=False).predict(module, _data("predict"),
                                                                             ckpt_path="ckpt/epoch=1")
    _assert_weights(module, _saved(tmp_path / "fit" / "ckpt" / "epoch=1"))


def test_last_before_a_fit_is_the_newest_save_in_dirpath(tmp_path):
    _best_fit(tmp_path)
    module = _module()
    fresh = Trainer(enable_progress_bar=False, callbacks=[Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt")])
    fresh.test(module, regression_loader(), ckpt_path="last")
    _assert_weights(module, _saved(tmp_path / "ckpt" / "epoch=3"))


def test_the_last_link_is_followed(tmp_path):
    checkpointer = Checkpointer(every_n_epochs=1, dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path, checkpointer, max_epochs=2)
    module = _module()
    Trainer(enable_progress_bar=False).test(module, regression_loader(), ckpt_path=tmp_path / "ckpt" / "last")
    _assert_weights(module, _saved(tmp_path / "ckpt" / "checkpoint_1"))


@pytest.mark.parametrize("ckpt_path", ["best", "last"])
def test_best_or_last_without_a_checkpointer_is_a_clear_error(tmp_path, ckpt_path):
    trainer, module = _fit(tmp_path, None, max_epochs=1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=rf"Trainer\.test\(ckpt_path='{ckpt_path}'\) names a checkpoint of the "
                                         r"Trainer's Checkpointer, and the Trainer has none\. Add "
                                         r"fittrain\.callbacks\.Checkpointer"):
        trainer.test(module, regression_loader(), ckpt_path=ckpt_path)
    _assert_weights(module, before)


@pytest.mark.parametrize("ckpt_path", ["best", "last"])
def test_best_or_last_before_any_save_is_a_clear_error(tmp_path, ckpt_path):
    trainer = Trainer(project_dir=tmp_path, enable_progress_bar=False,
                      callbacks=[Checkpointer(every_n_epochs=5, monitor="val_loss")])
    with pytest.raises(ValueError, match=rf"Trainer\.validate\(ckpt_path='{ckpt_path}'\): Checkpointer has saved no "
                                         r"checkpoint yet .*or pass the path of a checkpoint folder"):
        trainer.validate(_module(), regression_loader(), ckpt_path=ckpt_path)


def _damaged_weights(folder: pathlib.Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize("case, error, match", [
    ("missing", FileNotFoundError, r"Trainer\.test\(ckpt_path='.*nowhere'\) names a folder that does not exist"),
    ("folder of checkpoints", CheckpointError,
     r"ckpt_path='.*ckpt'\) names '.*ckpt', a folder of checkpoints, not a checkpoint\. Pass one of them, such as "
     r"its newest, '.*epoch=3'"),
    ("incomplete", CheckpointError, r"cannot be loaded: .*is incomplete: it has no manifest\.json"),
    ("damaged", CheckpointError, r"cannot be loaded: .*model\.safetensors.*Pass a complete checkpoint folder"),
])
def test_a_path_that_is_no_loadable_checkpoint_is_a_clear_error(tmp_path, case, error, match):
    trainer, module, _ = _best_fit(tmp_path)
    folder = {"missing": tmp_path / "nowhere", "folder of checkpoints": tmp_path / "ckpt",
              "incomplete": tmp_path / "ckpt" / "epoch=1", "damaged": tmp_path / "ckpt" / "epoch=1"}[case]
    if case == "incomplete":
        (folder / "manifest.json").unlink()
    if case == "damaged":
        _damaged_weights(folder)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(error, match=match):
        trainer.test(module, regression_loader(), ckpt_path=folder)
    _assert_weights(module, before)  # nothing was loaded


def test_a_damaged_best_checkpoint_is_a_clear_error(tmp_path):
    trainer, module, _ = _best_fit(tmp_path)
    _damaged_weights(tmp_path / "ckpt" / "epoch=1")
    with pytest.raises(CheckpointError, match=r"Trainer\.validate\(ckpt_path='best'\) cannot be loaded"):
        trainer.validate(module, regression_loader(), ckpt_path="best")


def test_ckpt_path_must_be_a_path():
    with pytest.raises(TypeError, match=r"`ckpt_path` must be a str or os\.PathLike.*Received: ckpt_path=3"):
        Trainer(enable_progress_bar=False).validate(_module(), regression_loader(), ckpt_path=3)


def test_none_evaluates_the_module_as_it_is(tmp_path):
    trainer, module, _ = _best_fit(tmp_path)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer.test(module, regression_loader(), ckpt_path=None)
    _assert_weights(module, before)
