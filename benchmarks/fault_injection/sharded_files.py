"""The attacks of the sharded-files category: damaged and hostile versions of every sharded file.

A sharded checkpoint of 2 ranks holds, beside the files of a full one, ``shards/__{rank}_0.distcp``
(each rank's chunks as raw bytes), ``shards/metadata.json`` (where every chunk lies),
``shards/values.pt`` (the optimizer's param_groups and the rest of each state) and
``data_states_{rank}.pt`` (each rank's loader positions). Damaged: each of them and the manifest
truncated, with a byte flipped, deleted or emptied. Hostile: rewritten as an attacker would, with
the manifest's size and CRC32 made to match, so only the loader's checks of what the file says
stop it. Each attack returns the name the refusal must carry (the file's base name).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

import torch

from fittrain.checkpoint import MANIFEST_NAME
from fittrain.checkpoint.sharded import METADATA_PATH, VALUES_NAME

from .attacks import Attack
from .damaged import DAMAGES
from .hostile import Planted, plant, torch_bytes

SHARD_FILES = ("shards/__0_0.distcp", "shards/__1_0.distcp", METADATA_PATH, VALUES_NAME, "data_states_0.pt",
               "data_states_1.pt", MANIFEST_NAME)
SHARD_DAMAGES: dict[str, Callable[[pathlib.Path], None]] = {**DAMAGES, "empty": lambda p: p.write_bytes(b"")}
#: The tensor whose metadata the hostile metadata.json files change: [64, 64], one chunk per rank.
TENSOR = "model_0/2.weight"


@dataclasses.dataclass
class ShardedAttack:
    """An attack on checkpoint_1, and the live run it is checked against.

    Attributes:
        attack: Changes the folder; returns the name a refusal must carry.
        groups: AdamW's parameter groups in the live run that loads it (`ShardedRig`).
        mismatch: The folder does not fit the live run (other parameter groups): "latest" may then
            raise CheckpointMismatchError, changing nothing, instead of passing over it.
        weights: The attack spoils what `load_model_weights` and `consolidate` read (the shards,
            metadata.json, values.pt, the manifest): they too must refuse, naming the file.
    """

    attack: Attack
    groups: int = 1
    mismatch: bool = False
    weights: bool = False


def _damage(damage: str, name: str) -> Attack:
    def attack(folder: pathlib.Path, marker: pathlib.Path) -> str:
        SHARD_DAMAGES[damage](folder / name)
        return pathlib.PurePath(name).name
    return attack


def _json(name: str, change: Callable[[dict[str, Any]], Any]) -> Attack:
    """Rewrites the JSON file `name` with `change` applied, listed in the manifest with a correct checksum."""
    def attack(folder: pathlib.Path, marker: pathlib.Path) -> str:
        data = json.loads((folder / name).read_text())
        change(data)
        plant(folder, name, json.dumps(data).encode())
        return pathlib.PurePath(name).name
    return attack


def _torch(name: str, change: Callable[[Any], Any]) -> Attack:
    """Rewrites the weights_only file `name` with `change` applied, listed with a correct checksum."""
    def attack(folder: pathlib.Path, marker: pathlib.Path) -> str:
        data = torch.load(folder / name, weights_only=True)
        data = change(data) or data
        plant(folder, name, torch_bytes(data))
        return pathlib.PurePath(name).name
    return attack


def _pickle(name: str) -> Attack:
    """`name` replaced by a pickle whose ``__reduce__`` writes the marker file, with a correct checksum."""
    def attack(folder: pathlib.Path, marker: pathlib.Path) -> str:
        plant(folder, name, torch_bytes([Planted(marker)]))
        return pathlib.PurePath(name).name
    return attack


# ===================================================================== metadata.json
def _last_chunk(data: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    entry = data["tensors"][TENSOR]
    return entry, entry["chunks"][-1][0]


def _half_covered(data: dict[str, Any]) -> None:
    entry, offset = _last_chunk(data)
    entry["chunks"].pop()
    data["storage"] = [s for s in data["storage"] if not (s["fqn"] == TENSOR and s["offset"] == offset)]


def _no_storage(data: dict[str, Any]) -> None:
    _, offset = _last_chunk(data)
    data["storage"] = [s for s in data["storage"] if not (s["fqn"] == TENSOR and s["offset"] == offset)]


def _rows(rows: int) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["tensors"][TENSOR]["size"].__setitem__(0, rows)


def _dimensions(data: dict[str, Any]) -> None:
    data["tensors"][TENSOR]["size"] = [2] * 5000


# ===================================================================== values.pt
def _groups(data: dict[str, Any]) -> dict[str, Any]:
    return data["optimizer_0"]["param_groups"][0]


def _two_groups(data: dict[str, Any]) -> None:
    group = _groups(data)
    params = group["params"]
    data["optimizer_0"]["param_groups"] = [{**group, "params": params[:3]},
                                           {**group, "params": params[3:], "lr": group["lr"] * 3}]


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda data: _groups(data).__setitem__(key, value)


def _position(key: str) -> Callable[[list[dict[str, Any]]], None]:
    return lambda states: states[0].__setitem__(key, 10**9)


def _nothing(folder: pathlib.Path, marker: pathlib.Path) -> str:
    return pathlib.PurePath(VALUES_NAME).name


HOSTILE: dict[str, ShardedAttack] = {
    f"metadata.json: chunks cover half of {TENSOR}": ShardedAttack(_json(METADATA_PATH, _half_covered), weights=True),
    f"metadata.json: {TENSOR} of 10**12 rows": ShardedAttack(_json(METADATA_PATH, _rows(10**12)), weights=True),
    f"metadata.json: {TENSOR} of 2**70 rows": ShardedAttack(_json(METADATA_PATH, _rows(2**70)), weights=True),
    "metadata.json: a chunk without a storage entry": ShardedAttack(_json(METADATA_PATH, _no_storage), weights=True),
    'metadata.json without "items"': ShardedAttack(_json(METADATA_PATH, lambda d: d.pop("items")), weights=True),
    f"metadata.json: {TENSOR} of 5,000 dimensions": ShardedAttack(_json(METADATA_PATH, _dimensions), weights=True),
    "values.pt: a pickle whose __reduce__ writes a file": ShardedAttack(_pickle(VALUES_NAME), weights=True),
    "values.pt: optimizer state that is a list": ShardedAttack(
        _torch(VALUES_NAME, lambda d: d["optimizer_0"].__setitem__("state", [1, 2, 3]))),
    "values.pt: lr='evil'": ShardedAttack(_torch(VALUES_NAME, _set("lr", "evil"))),
    "values.pt: betas='xx'": ShardedAttack(_torch(VALUES_NAME, _set("betas", "xx"))),
    "values.pt: param_groups=[]": ShardedAttack(
        _torch(VALUES_NAME, lambda d: d["optimizer_0"].__setitem__("param_groups", []))),
    "values.pt: 2 param groups, the live AdamW has 1": ShardedAttack(_torch(VALUES_NAME, _two_groups), mismatch=True),
    "1 param group saved, the live AdamW has 2": ShardedAttack(_nothing, groups=2, mismatch=True),
    **{f"data_states_1.pt: {key}=10**9": ShardedAttack(_torch("data_states_1.pt", _position(key)))
       for key in ("batches_consumed", "order_consumed")},
    "data_states_0.pt: a pickle whose __reduce__ writes a file": ShardedAttack(_pickle("data_states_0.pt")),
}
DAMAGED: dict[str, ShardedAttack] = {
    f"{damage} {name}": ShardedAttack(_damage(damage, name), weights=not name.startswith("data_states"))
    for damage in SHARD_DAMAGES for name in SHARD_FILES}
#: --quick: one damage of each kind of file, and one hostile file per defect of issue 23 and per file.
QUICK = ("flip a byte in shards/__1_0.distcp", "truncate shards/metadata.json", "empty shards/values.pt",
         "delete data_states_1.pt", "values.pt: a pickle whose __reduce__ writes a file",
         f"metadata.json: chunks cover half of {TENSOR}", "values.pt: lr='evil'",
         "1 param group saved, the live AdamW has 2", "data_states_1.pt: batches_consumed=10**9")


def sharded_attacks(quick: bool) -> dict[str, ShardedAttack]:
    """Every damaged and hostile version of the sharded files (quick: those in QUICK)."""
    attacks = {**{f"damaged: {k}": v for k, v in DAMAGED.items()}, **{f"hostile: {k}": v for k, v in HOSTILE.items()}}
    return {k: v for k, v in attacks.items() if k.split(": ", 1)[1] in QUICK} if quick else attacks
