"""The harness of the damaged and hostile categories: attack checkpoint_1, then load it and "latest".

Each attack works on a copy of one base project (checkpoint_0 and checkpoint_1). A load of the
attacked folder must raise CheckpointError naming the culprit file and change no live state;
"latest" must skip the folder with a warning and restore checkpoint_0 exactly; and a marker file
that planted code would write must never appear.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import warnings
from typing import Any, Callable

import torch

from fittrain.checkpoint import CheckpointError, CheckpointMismatchError, is_intact

from .checks import OTHER_SEED, differing, short
from .rig import Rig
from .sharded_rig import ShardedRig

#: The longest error message that is still read: a longer one echoes what a hostile file holds.
MESSAGE_LIMIT = 2000
#: Attacks `folder`; may plant code that writes the `marker` file; returns the file an error must name.
Attack = Callable[[pathlib.Path, pathlib.Path], str]


def expect_checkpoint_error(call: Callable[[], Any], culprit: str, what: str) -> list[str]:
    """Problems unless `call` raises CheckpointError naming `culprit`."""
    try:
        call()
    except CheckpointError as err:
        if culprit not in str(err):
            return [f"{what} raised CheckpointError without naming {culprit}: {short(err)}"]
        if len(str(err)) > MESSAGE_LIMIT:  # a hostile file echoed whole (thousands of dimensions)
            return [f"{what} raised a CheckpointError of {len(str(err)):,} characters: {short(err)}"]
        return []
    except Exception as err:
        return [f"{what} did not raise CheckpointError but {short(err)}"]
    return [f"{what} succeeded: the fault went unnoticed"]


def refused(rig: Rig | ShardedRig, folder: pathlib.Path, culprit: str) -> list[str]:
    """Problems with loading `folder`: it must be refused, naming `culprit`, and change nothing."""
    problems = []
    try:
        is_intact(folder)
    except Exception as err:
        problems.append(f"is_intact() raised {short(err)}")
    before = rig.snapshot()
    problems += expect_checkpoint_error(lambda: rig.acc.load_state(folder), culprit, f"load_state({folder.name})")
    changed = differing(rig.snapshot(), before)
    if changed:
        problems.append(f"the refused load_state({folder.name}) changed live state: {changed[:3]}")
    return problems


def skipped(rig: Rig | ShardedRig, folder: pathlib.Path, saved: dict[str, torch.Tensor],
            mismatch_ok: bool = False) -> list[str]:
    """Problems with "latest": it must skip `folder` with a warning and load checkpoint_0, whose state is `saved`.

    With `mismatch_ok` (a checkpoint that does not fit the live run, such as other parameter
    groups) it may instead raise CheckpointMismatchError, changing nothing: such an error is never
    passed over, as an older folder would not fit either.
    """
    before = rig.snapshot() if mismatch_ok else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = pathlib.Path(rig.acc.load_state())
        except Exception as err:
            if mismatch_ok and isinstance(err, CheckpointMismatchError):
                changed = differing(rig.snapshot(), before)
                return [f"the refused load_state() (latest) changed live state: {changed[:3]}"] if changed else []
            return [f"load_state() (latest) did not skip {folder.name}: it raised {short(err)}"]
    if loaded.name != "checkpoint_0":
        return [f"load_state() (latest) loaded {loaded.name}, not the intact checkpoint_0"]
    problems = []
    if not any(folder.name in str(w.message) for w in caught):
        problems.append(f"load_state() (latest) skipped {folder.name} without a warning naming it")
    wrong = differing(rig.snapshot(), saved)
    if wrong:
        problems.append(f"after load_state() (latest) the state differs from checkpoint_0's in {wrong[:3]}")
    return problems


class Attacks:
    """Attacks on checkpoint_1 of copies of one base project, checked with fresh rigs.

    The base project (checkpoint_0 and checkpoint_1, and checkpoint_0's state) is built on first use.
    """

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        self._base: tuple[pathlib.Path, dict[str, torch.Tensor]] | None = None

    def base(self) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
        if self._base is None:
            rig = Rig(self.workdir / "base", seed=0)
            rig.step()
            rig.acc.save_state()
            saved = rig.snapshot()
            rig.step(2)
            rig.acc.save_state()
            self._base = (self.workdir / "base", saved)
        return self._base

    def run(self, attack: Attack, scenario_dir: pathlib.Path, damaged: bool = False) -> list[str]:
        """Attacks a copy, then checks a rig seeded differently against it, and that the marker file
        was never written. A `damaged` folder must also fail `is_intact` (a hostile one may pass it:
        its checksums are right)."""
        base, saved = self.base()
        project, marker = scenario_dir / "project", scenario_dir / "executed"
        shutil.copytree(base, project)
        folder = project / "checkpoints" / "checkpoint_1"
        culprit = attack(folder, marker)
        problems = []
        with contextlib.suppress(Exception):  # refused reports is_intact raising
            if damaged and is_intact(folder):
                problems.append(f"is_intact() calls the damaged {folder.name} intact")
        rig = Rig(project, seed=OTHER_SEED)
        rig.step(3)
        problems += refused(rig, folder, culprit) + skipped(rig, folder, saved)
        if marker.exists():
            problems.append("code planted in the checkpoint was executed (its marker file exists)")
        return problems
