"""Damaged and planted checkpoints: detected before any training step, and never executed.

- A truncated model.safetensors and a flipped byte in optimizer.pt are caught by the manifest's
  sizes and CRC32s. An explicit `resume_from` path is an error that names the bad file, raised
  before the first batch; "latest" passes over the damaged newest checkpoint with a warning that
  names it, and resumes from the previous intact one.
- A planted pickle (a .pt file whose `__reduce__` runs a shell command), listed in the manifest
  with a correct checksum, is refused and never executed, whichever file of the layout it
  replaces: named in an error for an explicit path, passed over with a warning by "latest".
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import zlib

import pytest
import torch

from fittrain import Callback
from fittrain.checkpoint import MANIFEST_NAME, CheckpointError
from fittrain.checkpoint.run_folders import run_folder
from resume_support import differing

pytestmark = pytest.mark.subprocess


class _CountBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0
        self.first_step: int | None = None

    def on_train_batch_start(self, trainer) -> None:
        if self.first_step is None:
            self.first_step = trainer.state.global_step
        self.batches += 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory, train_job_module):
    """A project whose run saved at step 7 (checkpoint_0) and step 10 (checkpoint_1), and the
    final parameters of that run."""
    project = tmp_path_factory.mktemp("damaged") / "run"
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        trainer, module = _fit(train_job_module, project, "--save-steps", "7,10")
    finally:
        torch.use_deterministic_algorithms(previous)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return project, params


def _fit(job, project: pathlib.Path, *args: str, resume: str | None = None, counter: Callback | None = None):
    argv = ["--project", str(project), *args] + (["--resume", resume, "--seed", "999"] if resume else [])
    trainer, module, train, val = job.build(job.parse_args(argv), extra=(counter,) if counter else ())
    trainer.fit(module, train, val)
    return trainer, module


def _copy_project(project: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    shutil.copytree(project, to)
    return to


def _truncate(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {"model.safetensors": _truncate, "optimizer.pt": _flip_byte}


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_explicit_path_to_damaged_checkpoint_names_the_file_before_training(tmp_path, saved, train_job_module, name,
                                                                           deterministic):
    project = _copy_project(saved[0], tmp_path / "run")
    DAMAGES[name](run_folder(project) / "checkpoint_1" / name)
    counter = _CountBatches()
    with pytest.raises(CheckpointError) as info:
        _fit(train_job_module, project, resume=str(run_folder(project) / "checkpoint_1"), counter=counter)
    assert name in str(info.value) and "damaged" in str(info.value)
    assert counter.batches == 0


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_latest_skips_damaged_newest_with_a_warning(tmp_path, saved, train_job_module, name, deterministic):
    project = _copy_project(saved[0], tmp_path / "run")
    DAMAGES[name](run_folder(project) / "checkpoint_1" / name)
    counter = _CountBatches()
    with pytest.warns(UserWarning, match=f"checkpoint_1.*{name}"):
        _, module = _fit(train_job_module, project, resume="latest", counter=counter)
    assert counter.first_step == 7  # resumed from checkpoint_0
    assert not differing(module.state_dict(), saved[1]), "resuming from checkpoint_0 was not exact"


class _Planted:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(folder: pathlib.Path, name: str, marker: pathlib.Path) -> None:
    """Replaces `name` with a planted pickle and lists it in the manifest with a correct checksum."""
    torch.save({"state": _Planted(marker)}, folder / name)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_the_planted_pickle_is_live(tmp_path):
    """The payload does run when unpickled without weights_only, so the tests below mean something."""
    marker = tmp_path / "executed"
    _plant_file = tmp_path / "x.pt"
    torch.save({"state": _Planted(marker)}, _plant_file)
    torch.load(_plant_file, weights_only=False)
    assert marker.exists()


PICKLED = ["optimizer.pt", "scheduler.pt", "random_states_0.pt", "custom_checkpoint_0.pt", "custom_checkpoint_1.pt",
           "extra.pt"]


@pytest.mark.parametrize("name", PICKLED)
@pytest.mark.parametrize("resume", ["path", "latest"])
def test_planted_pickle_is_never_executed(tmp_path, saved, train_job_module, name, resume, deterministic):
    project = _copy_project(saved[0], tmp_path / "run")
    folder = run_folder(project) / "checkpoint_1"
    marker = tmp_path / "executed"
    _plant(folder, name, marker)
    counter = _CountBatches()
    target = str(folder) if resume == "path" else "latest"
    if name == "extra.pt":  # a file outside the layout is never even read
        _fit(train_job_module, project, resume=target, counter=counter)
        assert counter.first_step == 10
    elif resume == "latest":  # refused when parsed, so passed over like a checksum failure
        with pytest.warns(UserWarning, match=f"checkpoint_1.*{name}.*refused"):
            _, module = _fit(train_job_module, project, resume=target, counter=counter)
        assert counter.first_step == 7  # resumed from checkpoint_0
        assert not differing(module.state_dict(), saved[1]), "resuming from checkpoint_0 was not exact"
    else:
        with pytest.raises(CheckpointError) as info:
            _fit(train_job_module, project, resume=target, counter=counter)
        assert name in str(info.value) and "refused" in str(info.value)
        assert counter.batches == 0
    assert not marker.exists(), f"the pickle planted in {name} was executed"
