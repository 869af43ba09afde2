"""A sharded checkpoint's metadata.json, damaged or hostile, against every reader of it.

Two real gloo processes (FSDP2) write two checkpoints once for the module
(scripts/sharded_metadata_worker.py), so each tensor is cut into the chunks ranks really write
(one rank's chunk of the last layer is empty). Each test attacks a copy of metadata.json, fixing
the manifest as an attacker who knows the format would, and then `load_model_weights`,
`consolidate` and `load_state` (on one process: loading reshards) must each refuse it with a
CheckpointError naming the file, before anything is written or applied, and "latest" must pass
over it to the older intact checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

from fittrain.checkpoint import CheckpointError, load_model_weights
from fittrain.checkpoint.consolidate import consolidate
from fittrain.checkpoint.crc import file_checksum
from support.jobs import forked, load_script, run
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess

METADATA = "shards/metadata.json"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The worker's output: project/checkpoints/checkpoint_{0,1} and weights_{0,1}.pt (shared by every
    test worker: a test damages a copy, `project`)."""
    return shared_folder(tmp_path_factory, "sharded_metadata",
                         lambda out: run(forked(2, "sharded_metadata_worker.py", "--out", str(out))).check())


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    """scripts/sharded_worker.py, whose `build` makes the model and optimizer the job saved."""
    return load_script("sharded_worker")


@pytest.fixture
def project(job: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the job's project folder, for one test to damage."""
    shutil.copytree(job / "project", tmp_path / "project")
    return tmp_path / "project"


def _newest(project: pathlib.Path) -> pathlib.Path:
    return project / "checkpoints" / "checkpoint_1"


def _attack(folder: pathlib.Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrites metadata.json through `change` and fixes its manifest entry."""
    path = folder / METADATA
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    manifest = json.loads((folder / "manifest.json").read_text())
    size, crc = file_checksum(path)
    manifest["files"][METADATA] = {"size": size, "crc32": crc}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _storage(data: dict[str, Any], fqn: str, offset: list[int]) -> dict[str, Any]:
    return next(s for s in data["storage"] if s["fqn"] == fqn and s["offset"] == offset)


def _drop_a_ranks_chunk(data: dict[str, Any]) -> None:
    """Rank 1's rows of a weight are gone: the chunks cover only half of it."""
    data["tensors"]["model_0/2.weight"]["chunks"].pop(1)
    data["storage"].remove(_storage(data, "model_0/2.weight", [128, 0]))


def _shrink_a_chunk(data: dict[str, Any]) -> None:
    """A chunk (and its bytes) shortened to half its rows: a gap of 64 rows."""
    data["tensors"]["model_0/2.weight"]["chunks"][1][1] = [64, 256]
    _storage(data, "model_0/2.weight", [128, 0])["length"] = 64 * 256 * 4


def _overlap_chunks(data: dict[str, Any]) -> None:
    """Rank 1's chunk moved up by 64 rows: rows 64-127 twice, 192-255 never."""
    data["tensors"]["model_0/2.weight"]["chunks"][1][0] = [64, 0]
    _storage(data, "model_0/2.weight", [128, 0])["offset"] = [64, 0]


def _no_chunks(data: dict[str, Any]) -> None:
    data["tensors"]["model_0/0.bias"]["chunks"] = []
    data["storage"] = [s for s in data["storage"] if s["fqn"] != "model_0/0.bias"]


def _absurd_size(size: list[int]) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data["tensors"]["model_0/0.weight"]["size"] = size
    return change


def _absurd_forgery(size: list[int]) -> Callable[[dict[str, Any]], None]:
    """The size, one chunk covering it and that chunk's storage length, all consistent."""
    def change(data: dict[str, Any]) -> None:
        data["tensors"]["model_0/0.weight"] = {"dtype": "float32", "size": size, "chunks": [[[0, 0], size]]}
        data["storage"] = [s for s in data["storage"] if s["fqn"] != "model_0/0.weight"]
        data["storage"].append({"fqn": "model_0/0.weight", "offset": [0, 0], "file": "__0_0.distcp",
                                "start": 10**9, "length": size[0] * size[1] * 4})  # after every other chunk
    return change


def _no_storage_entry(data: dict[str, Any]) -> None:
    data["storage"].remove(_storage(data, "model_0/2.weight", [128, 0]))


def _no_items(data: dict[str, Any]) -> None:
    del data["items"]


def _thousands_of_dimensions(data: dict[str, Any]) -> None:
    data["tensors"]["model_0/0.weight"]["size"] = [1] * 5000


_GAP, _TWICE = "lie in no chunk", "lie in more than one chunk"
ATTACKS = {
    "a rank's chunk dropped": (_drop_a_ranks_chunk, rf"'model_0/2\.weight'.* dimension 0, indices 128 to 256 {_GAP}"),
    "a chunk shrunk": (_shrink_a_chunk, rf"'model_0/2\.weight'.* dimension 0, indices 192 to 256 {_GAP}"),
    "chunks overlapping": (_overlap_chunks, rf"'model_0/2\.weight'.* dimension 0, indices 64 to 128 {_TWICE}"),
    "no chunks at all": (_no_chunks, rf"'model_0/0\.bias'.* indices 0 to 256 {_GAP}"),
    "size 10**12 rows": (_absurd_size([10**12, 16]), rf"'model_0/0\.weight'.* indices 256 to {10**12} {_GAP}"),
    "size 2**70 rows": (_absurd_size([2**70, 16]), r"the size of 'model_0/0\.weight' is not a list of integers"),
    "forged 10**12 rows": (_absurd_forgery([10**12, 16]), r"places 'model_0/0\.weight' at bytes 10+ to \d+ of __0_0"),
    "forged 2**70 rows": (_absurd_forgery([2**70, 16]), r"the size of 'model_0/0\.weight' is not a list of integers"),
    "a chunk without storage": (_no_storage_entry, r"'model_0/2\.weight' at \[128, 0\] has no storage entry"),
    "no items": (_no_items, r"no \"items\".* pre-release fittrain"),
    "5000 dimensions": (_thousands_of_dimensions, r"'model_0/0\.weight' lies outside its size <list> \(5000 dim"),
}


def _refused(call: Callable[[], Any], folder: pathlib.Path, message: str) -> str:
    with pytest.raises(CheckpointError, match=message) as caught:
        call()
    text = str(caught.value)
    assert str(folder / METADATA) in text, text
    assert len(text) < 1000, f"{len(text)} characters: {text[:300]}..."
    assert "Traceback" not in text and "weights_only" not in text
    return text


@pytest.mark.filterwarnings("ignore:strategy='fsdp' needs more than one process")
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_damaged_metadata_file_is_refused_by_every_reader(project: pathlib.Path, tmp_path: pathlib.Path,
                                                            worker: ModuleType, attack: str) -> None:
    change, message = ATTACKS[attack]
    folder = _newest(project)
    _attack(folder, change)
    _refused(lambda: load_model_weights(folder), folder, message)
    _refused(lambda: consolidate(folder, tmp_path / "out"), folder, message)
    assert not (tmp_path / "out").exists()
    accelerator, model, *_ = worker.build(tmp_path, "sharded")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    _refused(lambda: accelerator.load_state(folder), folder, message)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_a_deleted_metadata_file_is_named_by_every_reader(project: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Found by the fault-injection benchmark: load_model_weights searched the folder for plain
    weights files and said there were none (FileNotFoundError), instead of naming the lost file."""
    folder = _newest(project)
    (folder / METADATA).unlink()
    _refused(lambda: load_model_weights(folder), folder, "missing|deleted|does not exist")
    _refused(lambda: consolidate(folder, tmp_path / "out"), folder, "missing|deleted|does not exist")
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:strategy='fsdp' needs more than one process")
def test_latest_passes_over_a_damaged_metadata_file(job: pathlib.Path, project: pathlib.Path,
                                                    worker: ModuleType) -> None:
    _attack(_newest(project), _drop_a_ranks_chunk)
    accelerator, model, *_ = worker.build(project.parent, "sharded")
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*checkpoint_1: it is damaged.* do not tile it"):
        loaded = accelerator.load_state()
    assert pathlib.Path(loaded).name == "checkpoint_0"
    expected = torch.load(job / "weights_0.pt", weights_only=True)
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


def test_the_intact_checkpoint_loads_whole_with_its_empty_chunks(job: pathlib.Path, project: pathlib.Path,
                                                                 tmp_path: pathlib.Path) -> None:
    """The control: the chunks ranks wrote (an empty one among them) pass every check."""
    expected = torch.load(job / "weights_1.pt", weights_only=True)
    weights = load_model_weights(_newest(project))
    assert sorted(weights) == sorted(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
    consolidate(_newest(project), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
