"""`fittrain consolidate CHECKPOINT OUT`, run as users run it (a subprocess), on one-process checkpoints.

The multi-process case (shards written by 2 and 4 ranks) is in tests/checkpoint/test_sharded_fsdp.py.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fittrain import Accelerator
from fittrain.checkpoint.consolidate import consolidate
from fittrain.launch.cli import main

pytestmark = pytest.mark.subprocess


def _consolidate(*args: str) -> subprocess.CompletedProcess:
    """The command as users run it (a fresh interpreter: no process group, nothing imported)."""
    return subprocess.run([sys.executable, "-m", "fittrain", "consolidate", *args], capture_output=True,
                          text=True, timeout=120)


def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """The same command line, in this process (faster); returns the exit code and stderr."""
    code = main(["consolidate", *args])
    return code, capsys.readouterr().err


def _checkpoint(folder: pathlib.Path, state_dict_type: str) -> dict[str, dict[str, torch.Tensor]]:
    accelerator = Accelerator(state_dict_type=state_dict_type)
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 8)), nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(first.parameters())
    first, second, optimizer = accelerator.prepare(first, second, optimizer)
    accelerator.backward(first(torch.randn(4, 64)).sum())
    optimizer.step()
    accelerator.save_state(folder)
    return {"0": {k: v.clone() for k, v in first.state_dict().items()},
            "1": {k: v.clone() for k, v in second.state_dict().items()}}


def _read(out: pathlib.Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return dict(load_file(out / "model.safetensors"))
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {k: v for name in files for k, v in load_file(out / name).items()}


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_checkpoints_weights_become_whole_safetensors_files(tmp_path: pathlib.Path, state_dict_type: str,
                                                              capsys: pytest.CaptureFixture) -> None:
    expected = _checkpoint(tmp_path / "ckpt", state_dict_type)
    code, err = _main(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max_shard_size", "20KB")
    assert code == 0, err
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) == 3  # 33 kB + 4 kB in 20 kB files
    weights = _read(tmp_path / "out")
    assert sorted(weights) == sorted(expected["0"])
    assert all(torch.equal(weights[k], v) for k, v in expected["0"].items())
    if state_dict_type == "sharded":
        done = _consolidate(str(tmp_path / "ckpt"), str(tmp_path / "second"), "--model", "1")
        assert done.returncode == 0 and "wrote 1 file(s)" in done.stdout, done.stderr
    else:
        assert _main(capsys, str(tmp_path / "ckpt"), str(tmp_path / "second"), "--model", "1")[0] == 0
    second = load_file(tmp_path / "second" / "model.safetensors")
    assert all(torch.equal(second[k], v) for k, v in expected["1"].items())


def test_bad_input_is_named_and_nothing_is_written(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    _checkpoint(tmp_path / "ckpt", "sharded")
    code, err = _main(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"), "--model", "5")
    assert code == 1 and "has no model 5; it holds models [0, 1]" in err
    shard = tmp_path / "ckpt" / "shards" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 1
    shard.write_bytes(bytes(data))
    code, err = _main(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert code == 1 and "__0_0.distcp" in err
    assert not (tmp_path / "out").exists()
    code, err = _main(capsys, str(tmp_path / "missing"), str(tmp_path / "out"))
    assert code == 1 and "does not exist" in err


@pytest.mark.parametrize("model, error", [("0", TypeError), (True, TypeError), (0.0, TypeError), (-1, ValueError)])
def test_a_model_that_is_not_an_index_is_named_before_anything_is_read(tmp_path: pathlib.Path, model: object,
                                                                       error: type) -> None:
    with pytest.raises(error, match=rf"`model` must be .*int.* Received: model={model!r}"):
        consolidate(tmp_path / "missing", tmp_path / "out", model=model)  # a missing checkpoint: checked first
    assert not (tmp_path / "out").exists()


def test_an_out_inside_the_checkpoint_is_refused_and_the_checkpoint_stays_intact(tmp_path: pathlib.Path) -> None:
    from fittrain.checkpoint import is_intact

    _checkpoint(tmp_path / "ckpt", "full")
    for out in (tmp_path / "ckpt", tmp_path / "ckpt" / "weights"):
        with pytest.raises(ValueError, match=r"`out` must lie outside the checkpoint folder.* Received: out="):
            consolidate(tmp_path / "ckpt", out)
    assert is_intact(tmp_path / "ckpt") and not (tmp_path / "ckpt" / "weights").exists()


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_an_out_that_is_a_file_is_named_before_anything_is_read(tmp_path: pathlib.Path, state_dict_type: str,
                                                                capsys: pytest.CaptureFixture) -> None:
    _checkpoint(tmp_path / "ckpt", state_dict_type)
    (tmp_path / "out").write_text("notes")
    with pytest.raises(FileExistsError, match=r"`out` must be a folder.* Received: out='.*out', which is a file"):
        consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert (tmp_path / "out").read_text() == "notes"
    code, err = _main(capsys, str(tmp_path / "ckpt"), str(tmp_path / "out" / "inner"))
    assert code == 1 and "which is a file" in err, err
