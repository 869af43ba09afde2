"""Category sharded-files: damaged and hostile sharded files (`sharded_files`), attacked on 2 ranks.

One 2-process FSDP2 job (torchrun, gloo, CPU; the ``_sharded`` role) builds the base project once
(checkpoint_0 and checkpoint_1, and each rank's state at checkpoint_0), then for each scenario
rank 0 copies it and attacks checkpoint_1, and every rank checks a fresh `ShardedRig`, seeded
differently, against the copy, as `attacks` does on one process: loading checkpoint_1 must raise a
CheckpointError naming the file on every rank and change nothing live; "latest" must pass over it
with a warning and restore checkpoint_0 exactly; a planted pickle must never run. Where the
attack spoils the weights, `load_model_weights` and `consolidate` must refuse it too (on rank 0). Rank 0 gathers
every rank's problems and reports them as the worker's events (see `worker`): a scenario that
hangs or kills the job is counted as failed, and the job restarts after it.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shutil
from typing import Any

import torch.distributed as dist

from fittrain.checkpoint import is_intact, load_model_weights
from fittrain.checkpoint.consolidate import consolidate

from .attacks import expect_checkpoint_error, refused, skipped
from .checks import OTHER_SEED, Outcome, merged, short
from .children import MODULE, Context, emit, on_ranks
from .sharded_files import ShardedAttack, sharded_attacks
from .sharded_rig import ShardedRig
from .worker import worker_category

ROLE = "_sharded"


# ===================================================================== in each rank
class _Base:
    """The base project, built by both ranks on first use, and this rank's state at checkpoint_0."""

    def __init__(self, workdir: pathlib.Path) -> None:
        self.project = workdir / "base"
        rig = ShardedRig(self.project, seed=0)
        rig.step()
        rig.acc.save_state()
        self.saved = rig.snapshot()
        rig.step(2)
        rig.acc.save_state()


def _attacked(spec: ShardedAttack, base: _Base, scenario_dir: pathlib.Path, damaged: bool) -> list[str]:
    """On every rank: rank 0 attacks a copy of the base; then each rank checks its own fresh rig. A
    `damaged` folder must also fail `is_intact` (a hostile one may pass it: its checksums are right)."""
    project, marker = scenario_dir / "project", scenario_dir / "executed"
    folder = project / "checkpoints" / "checkpoint_1"
    attacked: list[Any] = [None, None]  # the culprit, or why the attack itself failed
    if dist.get_rank() == 0:
        try:
            shutil.copytree(base.project, project)
            attacked[0] = spec.attack(folder, marker)
        except Exception as err:
            attacked[1] = f"the attack itself failed (a broken scenario): {short(err)}"
    dist.broadcast_object_list(attacked, src=0)  # every rank takes part, however the attack went
    culprit, broken = attacked
    if broken:
        return [broken]
    problems = []
    with contextlib.suppress(Exception):  # `refused` reports is_intact raising
        if damaged and dist.get_rank() == 0 and is_intact(folder):
            problems.append(f"is_intact() calls the damaged {folder.name} intact")
    rig = ShardedRig(project, seed=OTHER_SEED, groups=spec.groups)
    rig.step(3)
    problems += refused(rig, folder, culprit) + skipped(rig, folder, base.saved, spec.mismatch)
    if spec.weights and dist.get_rank() == 0:
        problems += _weights_refused(folder, culprit, scenario_dir / "consolidated")
    return problems


def _weights_refused(folder: pathlib.Path, culprit: str, out: pathlib.Path) -> list[str]:
    """Problems unless `load_model_weights` and `consolidate` refuse `folder` naming `culprit`, writing nothing."""
    name = folder.name
    problems = expect_checkpoint_error(lambda: load_model_weights(folder), culprit, f"load_model_weights({name})")
    problems += expect_checkpoint_error(lambda: consolidate(folder, out), culprit, f"consolidate({name})")
    if out.exists():
        problems.append(f"the refused consolidate({name}) wrote {sorted(p.name for p in out.iterdir())[:3]}")
    return problems


def _scenario(spec: ShardedAttack, base: _Base, scenario_dir: pathlib.Path, damaged: bool) -> list[str] | None:
    """Runs one scenario on every rank; rank 0 returns every rank's problems (the others None)."""
    try:
        problems = _attacked(spec, base, scenario_dir, damaged)
    except Exception as err:  # an error that escaped fittrain (or this script) is a finding too
        problems = [f"escaped: {short(err)}"]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    if dist.get_rank() != 0:
        return None
    if (scenario_dir / "executed").exists():
        gathered[0].append("code planted in the checkpoint was executed (its marker file exists)")
    shutil.rmtree(scenario_dir, ignore_errors=True)
    return merged(gathered)


def sharded_main(argv: list[str]) -> None:
    """On each rank: runs the sharded-files scenarios from --first on; rank 0 reports them as events."""
    parser = argparse.ArgumentParser(prog=f"{MODULE} {ROLE}")
    parser.add_argument("category", choices=["sharded-files"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--first", type=int, default=0, help="the index of the first scenario to run")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    attacks = sharded_attacks(args.quick)
    base: _Base | None = None
    for index, (name, spec) in enumerate(attacks.items()):
        if index < args.first:
            continue
        if base is None:
            base = _Base(workdir)  # initialises the process group (the Accelerator does)
            if dist.get_rank() == 0:
                emit(plan=list(attacks))
        if dist.get_rank() == 0:
            emit(start=name)
        problems = _scenario(spec, base, workdir / f"scenario-{index}", damaged=name.startswith("damaged"))
        if problems is not None:
            emit(end=name, problems=problems)
        dist.barrier()


# ===================================================================== in the parent
def sharded_files_category(ctx: Context) -> list[Outcome]:
    """Runs the sharded-files scenarios in one 2-rank job, restarted after a scenario that hangs or kills it."""
    return worker_category(ctx, "sharded-files", role=ROLE, launch=on_ranks)
