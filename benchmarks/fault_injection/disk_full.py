"""Category disk-full: saves that run out of space on a small tmpfs (root only; skipped otherwise).

A save that runs out of space must raise OSError "No space left on device", leave the previous
checkpoint intact and nothing behind, and a retry must succeed once a filler file is deleted. The
scenarios run in a worker whose files lie on the tmpfs, which is always unmounted.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Callable

from fittrain.checkpoint import is_intact

from .checks import Outcome, broken_checkpoints, short
from .children import Context
from .rig import Rig
from .worker import Scenarios, worker_category

DISK_MB = 6
DISK_WIDTH = 256  # a checkpoint of about 0.5 MB
#: Bytes left free, given a checkpoint's size: the save runs out of space at different files.
ROOM: dict[str, Callable[[int], int]] = {
    "no room at all": lambda size: 0, "room for half a checkpoint": lambda size: size // 2,
    "room for 90% of a checkpoint": lambda size: size * 9 // 10,
    "room for all but 1 KB of a checkpoint": lambda size: size - 1024}


# ===================================================================== in the worker
def _fill(filler: pathlib.Path, leave: int) -> None:
    """Writes `filler` until at most `leave` bytes are free on its file system."""
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            stat = os.statvfs(filler.parent)
            free = stat.f_bavail * stat.f_frsize
            if free <= leave:
                return
            try:
                os.write(fd, b"\0" * min(1 << 16, max(free - leave, 4096)))
            except OSError:
                return  # full
    finally:
        os.close(fd)


def _save_runs_out(rig: Rig, async_save: bool, size: int) -> list[str]:
    """Problems unless a save on the full disk raises OSError "No space left on device"."""
    try:
        rig.acc.save_state(async_save=async_save)
        rig.acc.wait_for_checkpoint()
    except Exception as err:
        if isinstance(err, OSError) and "No space left on device" in str(err):
            return []
        return [f"the save that ran out of space did not raise OSError 'No space left on device' but {short(err)}"]
    return [f"the save succeeded on a disk without room for it ({size} bytes): where did it write?"]


def _retry(rig: Rig, async_save: bool) -> list[str]:
    """Problems unless a save succeeds, and writes an intact checkpoint, once there is room again."""
    try:
        retried = pathlib.Path(rig.acc.save_state(async_save=async_save))
        rig.acc.wait_for_checkpoint()
        if is_intact(retried):
            return []
    except Exception as err:
        return [f"the retry after freeing space raised {short(err)}"]
    return [f"the retry after freeing space wrote {retried.name}, which is not intact"]


def _disk_full(room: Callable[[int], int], async_save: bool, scenario_dir: pathlib.Path) -> list[str]:
    """Saves once, fills the disk until `room(size of that checkpoint)` bytes are free, saves again,
    then deletes the filler and retries."""
    project, filler = scenario_dir / "project", scenario_dir / "filler"
    root = project / "checkpoints"
    rig = Rig(project, seed=0, width=DISK_WIDTH)
    rig.step()
    first = pathlib.Path(rig.acc.save_state())
    size = sum(f.stat().st_size for f in first.iterdir())
    _fill(filler, room(size))
    rig.step()
    problems = _save_runs_out(rig, async_save, size) + broken_checkpoints(root, "after the failed save")
    if not is_intact(first):
        problems.append(f"the previous checkpoint {first.name} is no longer intact")
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    if leftovers:
        problems.append(f"the failed save left {leftovers} behind, taking space")
    filler.unlink()
    return problems + _retry(rig, async_save)


def disk_full_scenarios(workdir: pathlib.Path, quick: bool) -> Scenarios:
    """Every amount of room, for sync and async saves (quick: a sync save with room for half)."""
    cases = [(mode, room) for mode in ("sync", "async") for room in ROOM]
    if quick:
        cases = [("sync", "room for half a checkpoint")]
    return {f"{mode} save, {room}": (lambda s, room=ROOM[room], a=mode == "async": _disk_full(room, a, s))
            for mode, room in cases}


# ===================================================================== in the parent
def disk_full_category(ctx: Context) -> list[Outcome] | str:
    """Runs the disk-full worker on a fresh tmpfs; returns why it was skipped where it cannot."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (mount -t tmpfs needs it)"
    disk = ctx.folder("tmpfs")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"mount -t tmpfs failed: {short(err)}"
    if mounted.returncode != 0:
        return f"mount -t tmpfs failed: {(mounted.stderr.strip().splitlines() or ['?'])[0]}"
    try:
        return worker_category(ctx, "disk-full", disk)
    finally:
        ctx.kill_all(but_references=True)  # nothing may keep the file system busy
        if subprocess.run(["umount", str(disk)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)
