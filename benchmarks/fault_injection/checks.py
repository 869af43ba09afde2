"""What a scenario found (`Outcome`), and the checks of fittrain's promises that several categories share.

A check returns a list of problems, each a short line of plain text; an empty list means the
promise held.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import torch

from fittrain.checkpoint import is_intact, list_checkpoints

#: The seed of a resumed process or rig: whatever a checkpoint fails to restore then changes the result.
OTHER_SEED = 999


@dataclasses.dataclass
class Outcome:
    """One scenario: it survived when `problems` is empty."""

    scenario: str
    problems: list[str]


def short(err: BaseException) -> str:
    """`Type: first line of the message`, at most 240 characters, with temporary folders elided."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # Keep the last two parts of a path (".../checkpoint_1/optimizer.pt"): the temporary folders say nothing.
    text = re.sub(r"(?:/[^\s'/]+)+(/[^\s'/]+/[^\s'/]+)", r"...\1", f"{type(err).__name__}: {lines[0] if lines else ''}")
    return text if len(text) <= 240 else text[:237] + "..."


def broken_checkpoints(root: pathlib.Path, when: str) -> list[str]:
    """Problems: checkpoint_N folders under `root` that do not verify, or none at all."""
    folders = list_checkpoints(root)
    if not folders:
        return [f"no checkpoint_N left {when}"]
    problems = []
    for folder in folders:
        try:
            intact = is_intact(folder)
        except Exception as err:
            problems.append(f"is_intact({folder.name}) raised {short(err)} {when}")
            continue
        if not intact:
            problems.append(f"{folder.name} exists but is not intact {when}")
    return problems


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys in only one of `a` and `b`; when they have the same keys, those whose tensors differ."""
    return sorted(set(a) ^ set(b)) or [k for k in a if not torch.equal(a[k], b[k])]


def merged(per_rank: list[list[str]]) -> list[str]:
    """Every rank's problems: those that all ranks found once, the others prefixed with their rank."""
    common = [p for p in per_rank[0] if all(p in problems for problems in per_rank)]
    return common + [f"rank {r}: {p}" for r, problems in enumerate(per_rank) for p in problems if p not in common]


def trainer_roots(project: pathlib.Path) -> list[pathlib.Path]:
    """The folders that hold a Trainer's checkpoints in `project`, whichever layout it uses:
    ``checkpoints/`` itself, or one folder per run (``checkpoints/<run>/``); ``[checkpoints/]``
    while there are none yet."""
    root = project / "checkpoints"
    found = set()
    for folder in [root, *_subfolders(root)]:
        if any(is_checkpoint_name(name) for name in _names(folder)):
            found.add(folder)
    return sorted(found) or [root]


def trainer_checkpoints_broken(project: pathlib.Path, when: str) -> list[str]:
    """`broken_checkpoints` of every folder of a Trainer's checkpoints in `project` (`trainer_roots`)."""
    return [problem for root in trainer_roots(project) for problem in broken_checkpoints(root, when)]


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a checkpoint's (checkpoint_N) or a save's in progress (.checkpoint_N.tmp)."""
    return re.fullmatch(r"\.?checkpoint_\d+(\.tmp)?", name) is not None


def _names(folder: pathlib.Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:  # not there (yet), or pruned meanwhile
        return []


def _subfolders(folder: pathlib.Path) -> list[pathlib.Path]:
    return [folder / name for name in _names(folder) if not is_checkpoint_name(name) and (folder / name).is_dir()]
