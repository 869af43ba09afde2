"""Category sharded-kill: SIGKILL inside a sharded save, and inside an async sharded save, of 2 ranks.

A 2-process FSDP2 job (torchrun, gloo, CPU; the ``_sharded_job`` role) trains a `ShardedRig` and
saves after every step (automatic naming, ``total_limit=3``), recording each rank's state just
before each save. Once a save is half written (a temporary folder with files and no manifest)
after a committed one and a step drawn from ``--seed``, rank 1, rank 0, or every rank and
torchrun get SIGKILL. Then every
``checkpoint_N`` left must verify and no temporary folder may be listed as one; and a second job,
seeded differently and started beside the first, loads "latest" on both ranks: it must load the
newest intact folder, and each rank's state must equal, bitwise, the one recorded for its step.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import warnings
from typing import Any, Callable

import torch

from fittrain.checkpoint import list_checkpoints

from .checks import OTHER_SEED, Outcome, broken_checkpoints, differing, merged, short
from .children import (
    JOB_TIMEOUT_S,
    MODULE,
    Child,
    Context,
    emit,
    killed_after,
    on_ranks,
    role_args,
    wait_for_file,
    wait_until,
)
from .job import progress
from .kills import half_written
from .sharded_rig import ShardedRig

JOB_ROLE = "_sharded_job"
TARGETS = ("rank 1", "rank 0", "every rank and torchrun")
#: Wide enough that a save takes long enough for the kill to land in it (about 3 MB a checkpoint).
KILL_WIDTH = 384
#: The kill lands in the save after a random step up to this one (pruning under way from step 4 on).
LAST_KILL_STEP = 10
#: Records kept: "latest" is one of the last few saves (total_limit=3, and one being written).
RECORDS_KEPT = 8


# ===================================================================== in each rank
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{MODULE} {JOB_ROLE}")
    parser.add_argument("--project", required=True, type=pathlib.Path)
    parser.add_argument("--records", required=True, type=pathlib.Path)
    parser.add_argument("--progress")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--check", action="store_true", help="load 'latest' and compare it with the records")
    parser.add_argument("--wait-for")
    return parser


def _write(path: pathlib.Path, write: Callable[[pathlib.Path], Any]) -> None:
    """Writes `path` through a temporary sibling, so that the parent never reads half a file."""
    temp = path.with_name(f".{path.name}.tmp")
    write(temp)
    os.replace(temp, path)


def _train(rig: ShardedRig, args: argparse.Namespace) -> None:
    """Trains and saves after every step, recording each rank's state (and pid and step) before the save."""
    rank = rig.acc.process_index
    args.records.mkdir(parents=True, exist_ok=True)
    for _ in range(args.steps):
        rig.step()
        step = rig.counter.step
        _write(args.records / f"step_{step}.{rank}.pt", lambda p: torch.save(rig.snapshot(), p))
        (args.records / f"step_{step - RECORDS_KEPT}.{rank}.pt").unlink(missing_ok=True)
        _write(pathlib.Path(f"{args.progress}.{rank}"), lambda p, step=step: p.write_text(f"{os.getpid()} {step}"))
        rig.acc.save_state(async_save=args.async_save)
    rig.acc.wait_for_checkpoint()


def _check(rig: ShardedRig, args: argparse.Namespace) -> None:
    """Loads "latest" and reports, as an event of this rank, what it loaded and how it differs from the record."""
    rank = rig.acc.process_index
    rig.step()  # the live state now differs from every checkpoint's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # passing over a damaged folder is not what this checks
            loaded = pathlib.Path(rig.acc.load_state()).name
    except Exception as err:
        emit(rank=rank, problems=[f"load_state() (latest) raised {short(err)}"])
        return
    step = rig.counter.step
    record = args.records / f"step_{step}.{rank}.pt"
    if not record.exists():
        emit(rank=rank, loaded=loaded, problems=[f"{loaded} holds step {step}, whose state was not recorded"])
        return
    wrong = differing(rig.snapshot(), torch.load(record, weights_only=True))
    problem = f"the state loaded from {loaded} differs from the state saved at step {step} in {wrong[:3]}"
    emit(rank=rank, loaded=loaded, problems=[problem] if wrong else [])


def sharded_job_main(argv: list[str]) -> None:
    """One rank of the job that saves until killed, or (--check) of the one that loads "latest" after."""
    args = _parser().parse_args(argv)
    wait_for_file(args.wait_for)
    rig = ShardedRig(args.project, seed=OTHER_SEED if args.check else 0, limit=3, width=KILL_WIDTH)
    (_check if args.check else _train)(rig, args)
    rig.acc.end_training()


# ===================================================================== in the parent
def _saving(root: pathlib.Path, steps: pathlib.Path, after: int) -> bool:
    """Whether both ranks have trained `after` steps, a checkpoint is committed and a newer one is half written."""
    return (min(progress(steps, 0)[1], progress(steps, 1)[1]) >= after and bool(list_checkpoints(root))
            and half_written(root))


def _kill(victim: Child, steps: pathlib.Path, target: str) -> None:
    if target.startswith("rank"):
        try:
            os.kill(progress(steps, int(target[-1]))[0], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died by itself meanwhile: what follows still checks what it left
    else:
        victim.kill()


def _names_only_checkpoints(root: pathlib.Path) -> list[str]:
    """Problems: a listed checkpoint that is not named checkpoint_N (a temporary folder taken for one)."""
    wrong = [f.name for f in list_checkpoints(root) if not re.fullmatch(r"checkpoint_\d+", f.name)]
    return [f"list_checkpoints() takes {wrong[:3]} for checkpoints"] if wrong else []


def _checked(checker: Child, root: pathlib.Path) -> list[str]:
    """Problems the check job found on each rank, or with what it loaded (not the newest intact folder)."""
    checker.wait()
    newest = list_checkpoints(root)[-1].name if list_checkpoints(root) else None
    events = {e["rank"]: e for e in checker.events() if "rank" in e}
    per_rank = []
    for rank in (0, 1):
        event = events.get(rank)
        if event is None:
            per_rank.append([f"the check reported nothing: the check job {checker.ending()}"])
            continue
        loaded = event.get("loaded")
        per_rank.append(event["problems"] + ([f"load_state() (latest) loaded {loaded}, not the newest intact {newest}"]
                                             if loaded and loaded != newest else []))
    return merged(per_rank)


def _kill_and_check(ctx: Context, async_save: bool, target: str, after: int) -> list[str]:
    """Kills `target` inside the first save that is half written once `after` steps are trained,
    checks the folders, then lets the check job load "latest"."""
    run = ctx.folder("sharded-kill")
    project, records, steps, go = run / "project", run / "records", run / "progress", run / "go"
    root = project / "checkpoints"
    common = ["--project", project, "--records", records]
    victim = ctx.start(on_ranks(role_args(JOB_ROLE, *common, "--progress", steps,
                                          *(["--async-save"] if async_save else []))), run / "victim.log")
    # The check job imports torch while the victim trains; it loads once `go` exists.
    checker = ctx.start(on_ranks(role_args(JOB_ROLE, *common, "--check", "--wait-for", go)), run / "checker.log")
    with killed_after(victim, checker):
        if not wait_until(lambda: _saving(root, steps, after), victim, JOB_TIMEOUT_S):
            return [f"no save was caught half written after a committed one: the job {victim.ending()}"]
        _kill(victim, steps, target)
        victim.wait()  # torchrun ends the other rank once one died (its deadline bounds this)
        victim.kill()  # and nothing of the job may write on
        problems = broken_checkpoints(root, "after the kill") + _names_only_checkpoints(root)
        go.touch()
        return problems + _checked(checker, root)


def sharded_kill_category(ctx: Context) -> list[Outcome]:
    """SIGKILL to each target inside a sync and an async sharded save after a random step from 1 to
    `LAST_KILL_STEP` (quick: rank 1, async, after step 1)."""
    cases = [(True, "rank 1", 1)]
    if not ctx.quick:
        cases = [(a, t, ctx.rng.randint(1, LAST_KILL_STEP)) for a in (False, True) for t in TARGETS]
    return [Outcome(f"SIGKILL to {target} inside {'an async' if a else 'a'} sharded save after step {after}",
                    _kill_and_check(ctx, a, target, after)) for a, target, after in cases]
