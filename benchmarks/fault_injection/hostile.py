"""Category hostile: files crafted to execute code, exhaust the parser, or carry the wrong types.

A pickle whose ``__reduce__`` writes a marker file (listed in the manifest with a correct
checksum, so only the loader's refusal to unpickle stops it), a manifest nested 100,000 deep, a
huge or garbage accelerator_state.json, JSON of the wrong types: nothing may execute or hang, only
CheckpointError may escape, and "latest" must skip such a checkpoint with a warning (see `attacks`).
"""

from __future__ import annotations

import json
import pathlib
import random
import tempfile
import zlib
from typing import Any, Callable

import torch

from fittrain.checkpoint import MANIFEST_NAME

from .attacks import Attack, Attacks
from .worker import Scenarios

DEEP = 100_000
STATE = "accelerator_state.json"


class Planted:
    """Unpickling this opens `marker` for writing: code that runs, which must never happen."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (self.marker, "w")


def torch_bytes(obj: Any) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(obj, pathlib.Path(tmp) / "x.pt")
        return (pathlib.Path(tmp) / "x.pt").read_bytes()


def edit_manifest(folder: pathlib.Path, change: Callable[[dict[str, Any]], Any]) -> str:
    """Applies `change` to the manifest's file records and writes it back; returns the manifest's name."""
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest["files"])
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return MANIFEST_NAME


def _list(folder: pathlib.Path, name: str, data: bytes) -> str:
    """Lists `name` in the manifest with the correct size and CRC32 of `data`; returns the manifest's name."""
    return edit_manifest(folder, lambda files: files.__setitem__(name, {"size": len(data), "crc32": zlib.crc32(data)}))


def plant(folder: pathlib.Path, name: str, data: bytes) -> str:
    """Writes `name` and lists it in the manifest with its correct size and CRC32; returns `name`."""
    (folder / name).write_bytes(data)
    _list(folder, name, data)
    return name


def _outside(folder: pathlib.Path) -> str:
    """Lists "../outside", a real file beside the folder, in the manifest with a correct checksum."""
    data = b'{"step": 1}'
    (folder.parent / "outside").write_bytes(data)
    return _list(folder, "../outside", data)


def _replace_manifest(folder: pathlib.Path, files_json: str) -> str:
    head = '{"format": "fittrain-checkpoint", "version": 1, "files": '
    (folder / MANIFEST_NAME).write_text(head + files_json + "}")
    return MANIFEST_NAME


def _string_size(files: dict[str, Any]) -> None:
    files["optimizer.pt"]["size"] = str(files["optimizer.pt"]["size"])


HOSTILE: dict[str, Attack] = {
    # Listed in the manifest with a correct checksum, so only the loader's refusal to unpickle stops it.
    **{f"pickle whose __reduce__ writes a file, as {name}": (
        lambda f, m, name=name: plant(f, name, torch_bytes([Planted(m)])))
       for name in ("optimizer.pt", "scheduler.pt", "random_states_0.pt", "custom_checkpoint_0.pt",
                    "model.safetensors")},
    "manifest nested 100,000 deep": lambda f, m: _replace_manifest(f, "[" * DEEP + "]" * DEEP),
    "manifest whose files is a list": lambda f, m: _replace_manifest(f, "[]"),
    "manifest with a size that is a string": lambda f, m: edit_manifest(f, _string_size),
    "manifest naming ../outside": lambda f, m: _outside(f),
    f"{STATE}: 32 MB of random bytes": lambda f, m: plant(f, STATE, random.Random(0).randbytes(32 << 20)),
    f"{STATE} nested 100,000 deep": lambda f, m: plant(f, STATE, b"[" * DEEP + b"]" * DEEP),
    f"{STATE}: a 1,000,000-digit number": lambda f, m: plant(f, STATE, b"9" * 1_000_000),
    f"{STATE} that is a list": lambda f, m: plant(f, STATE, b"[1, 2]"),
    f"{STATE} whose step is a string": lambda f, m: plant(f, STATE, b'{"step": "ten", "num_processes": 1}'),
    f"{STATE} whose dataloaders is a number": lambda f, m: plant(f, STATE, b'{"step": 1, "dataloaders": 5}'),
    "optimizer.pt that is a list": lambda f, m: plant(f, "optimizer.pt", torch_bytes([1, 2])),
    "scheduler.pt that is a list": lambda f, m: plant(f, "scheduler.pt", torch_bytes([1, 2])),
    "random_states_0.pt with strings for states": lambda f, m: plant(
        f, "random_states_0.pt", torch_bytes({"python": "x", "numpy": "x", "torch": "x"})),
}


def payload_is_live(scenario_dir: pathlib.Path) -> list[str]:
    """Problems when the planted payload does not even run under torch.load(weights_only=False)."""
    live = scenario_dir / "live"
    live.mkdir(parents=True)
    (live / "x.pt").write_bytes(torch_bytes([Planted(live / "ran")]))
    torch.load(live / "x.pt", weights_only=False)
    return [] if (live / "ran").exists() else ["the planted payload does not run even when unpickled: a broken test"]


def hostile_scenarios(workdir: pathlib.Path, quick: bool) -> Scenarios:
    """Every hostile file (quick: the first pickle); the first also checks that its payload is live."""
    attacks = Attacks(workdir)
    names = list(HOSTILE)[:1] if quick else list(HOSTILE)
    scenarios = {name: (lambda s, name=name: attacks.run(HOSTILE[name], s)) for name in names}
    scenarios[names[0]] = lambda s, run=scenarios[names[0]]: payload_is_live(s) + run(s)
    return scenarios
