"""Category damaged: truncate, flip a byte in, or delete each file of the newest checkpoint in turn.

Loading it must raise CheckpointError naming that file, and "latest" must fall back to the
previous checkpoint (see `attacks`).
"""

from __future__ import annotations

import pathlib
from typing import Callable

from fittrain.checkpoint import MANIFEST_NAME

from .attacks import Attack, Attacks
from .worker import Scenarios

FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "random_states_0.pt", "custom_checkpoint_0.pt",
         "accelerator_state.json", MANIFEST_NAME)


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES: dict[str, Callable[[pathlib.Path], None]] = {
    "truncate": _truncate, "flip a byte in": _flip_byte, "delete": pathlib.Path.unlink}


def _damage(damage: str, name: str) -> Attack:
    def attack(folder: pathlib.Path, marker: pathlib.Path) -> str:
        DAMAGES[damage](folder / name)
        return name
    return attack


def damaged_scenarios(workdir: pathlib.Path, quick: bool) -> Scenarios:
    """Every damage to every file (quick: a byte flipped in optimizer.pt)."""
    attacks = Attacks(workdir)
    pairs = [("flip a byte in", "optimizer.pt")] if quick else [(d, n) for d in DAMAGES for n in FILES]
    return {f"{d} {n}": (lambda s, d=d, n=n: attacks.run(_damage(d, n), s, damaged=True)) for d, n in pairs}
