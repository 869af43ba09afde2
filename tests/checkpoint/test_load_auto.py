"""`Accelerator.load_state("auto")`: the newest checkpoint where one was saved, nothing where none was."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fittrain import Accelerator, ProjectConfiguration


def _accelerator(project: pathlib.Path, automatic: bool = True) -> tuple[Accelerator, torch.nn.Module]:
    acc = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=automatic))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model


def test_nothing_saved_loads_nothing_and_says_so(tmp_path, capsys):
    acc, model = _accelerator(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert acc.load_state("auto") is None
    assert f"load_state('auto'): nothing saved under {str(tmp_path / 'checkpoints')!r} yet" in capsys.readouterr().out
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_saved_checkpoint_is_loaded_as_with_no_folder(tmp_path):
    acc, model = _accelerator(tmp_path)
    acc.save_state()
    with torch.no_grad():
        model.weight.add_(1.0)
    second = acc.save_state()
    with torch.no_grad():
        model.weight.zero_()
    assert acc.load_state("auto") == second == str(tmp_path / "checkpoints" / "checkpoint_1")
    assert model.weight.abs().sum() > 0  # restored from the newest save, not the zeros


def test_damaged_checkpoints_are_not_started_over(tmp_path):
    acc, _ = _accelerator(tmp_path)
    saved = pathlib.Path(acc.save_state())
    (saved / "model.safetensors").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="damaged"), \
            pytest.raises(FileNotFoundError, match=r"load_state\('auto'\) found checkpoints .* none that loads"):
        acc.load_state("auto")


def test_auto_needs_automatic_naming(tmp_path):
    acc, _ = _accelerator(tmp_path, automatic=False)
    with pytest.raises(ValueError, match=r"load_state\('auto'\) needs a ProjectConfiguration with "
                                         r"automatic_checkpoint_naming=True.*Received: input_dir='auto'"):
        acc.load_state("auto")
