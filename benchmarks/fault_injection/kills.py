"""Categories kill-sync, kill-async and sigterm-rank: a signal to a training job, then an exact resume.

A job that saves is killed (SIGKILL inside a save or a random moment after a step; SIGTERM to one
rank of two, or to the whole group). Every checkpoint left must verify, and a successor, seeded
differently and started beside the victim, resumes "latest" and must end with the uninterrupted
run's weights.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import time

import safetensors
import safetensors.torch

from fittrain.checkpoint import MANIFEST_NAME, list_checkpoints
from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE

from .checks import OTHER_SEED, Outcome, differing, trainer_checkpoints_broken, trainer_roots
from .children import SIGTERM_EPOCHS, Child, Context, job_args, killed_after, torchrun_args, wait_until
from .job import progress

#: Optimizer steps (of 64) after which SIGKILL lands, a random fraction of a step later.
KILL_STEPS = (1, 10, 40)
KILL_JITTER_S = 0.03


# ===================================================================== the exact resume
def same_weights(result: pathlib.Path, reference: pathlib.Path, what: str) -> list[str]:
    """Problems: final weights (and step) of `result` not torch.equal to the reference's."""
    got, want = safetensors.torch.load_file(result), safetensors.torch.load_file(reference)
    steps = []
    for path in (result, reference):
        with safetensors.safe_open(str(path), "pt") as f:
            steps.append((f.metadata() or {}).get("global_step"))
    different = differing(want, got)
    if different or steps[0] != steps[1]:
        return [f"{what} ended at step {steps[0]} with weights that differ from the uninterrupted run's "
                f"(step {steps[1]}) in {different[:3]}"]
    return []


def resumed_exactly(ctx: Context, successor: Child, result: pathlib.Path, kind: str) -> list[str]:
    """Problems: the resumed run failed, or its final weights differ from the uninterrupted run's."""
    if successor.wait() != 0 or not result.exists():
        return [f"resume_from='latest' {successor.ending()}"]
    reference, why = ctx.reference(kind)
    return same_weights(result, reference, "the resumed run") if reference else [why]


# ===================================================================== 1, 2: SIGKILL during saves
def kill_category(ctx: Context, async_save: bool) -> list[Outcome]:
    """SIGKILL inside a save (quick: only this), then at random moments after chosen steps."""
    outcomes = [Outcome("SIGKILL inside a save (its .tmp folder has files, no manifest)",
                        _kill_and_resume(ctx, None, async_save))]
    for step in () if ctx.quick else KILL_STEPS:
        moment = (step, ctx.rng.uniform(0.0, KILL_JITTER_S))
        outcomes.append(Outcome(f"SIGKILL {moment[1] * 1000:.0f} ms after step {step}",
                                _kill_and_resume(ctx, moment, async_save)))
    return outcomes


def half_written(root: pathlib.Path) -> bool:
    """Whether a save is in progress under `root`: a hidden .tmp folder with files but no manifest."""
    for temp in root.glob(".checkpoint_*.tmp") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            names = os.listdir(temp)
            if names and MANIFEST_NAME not in names:
                return True
    return False


def _any_checkpoint(project: pathlib.Path) -> bool:
    """Whether the Trainer has committed a checkpoint in `project` (in either layout: `trainer_roots`)."""
    return any(list_checkpoints(root) for root in trainer_roots(project))


def _kill_and_resume(ctx: Context, moment: tuple[int, float] | None, async_save: bool) -> list[str]:
    """Kills a saving job at `moment` (seconds after an optimizer step, once a checkpoint exists;
    None: inside a save), checks the folders, then lets a successor resume "latest" and compares it
    with the uninterrupted run."""
    run = ctx.folder("kill")
    project, go, result, steps = run / "project", run / "go", run / "resumed.safetensors", run / "progress"
    saving = ["--every", 1, "--limit", 3, *(["--async-save"] if async_save else [])]
    # 64 steps of a few ms each, plus a save after each: most kills land inside a save.
    victim = ctx.start(job_args(project, "--batch-sleep", 0.005, "--progress", steps, *saving), run / "victim.log")
    # The successor imports torch while the victim trains; it resumes once `go` exists.
    successor = ctx.start(job_args(project, "--resume", "latest", "--seed", OTHER_SEED, "--wait-for", go,
                                   "--result", result, *saving), run / "successor.log")
    with killed_after(victim, successor):
        step = moment[0] if moment else 0
        if not wait_until(lambda: _any_checkpoint(project) and progress(steps, 0)[1] >= step, victim):
            return [f"the job never saved a checkpoint and reached step {step}: it {victim.ending()}"]
        if moment is None:
            wait_until(lambda: any(half_written(root) for root in trainer_roots(project)), victim)
        else:
            time.sleep(moment[1])
        if not victim.running():
            return [f"the job ended before the kill, so nothing was tested: it {victim.ending()}"]
        victim.kill()
        problems = trainer_checkpoints_broken(project, "after the kill")
        go.touch()
        problems += resumed_exactly(ctx, successor, result, "single")
        return problems + trainer_checkpoints_broken(project, "after the resumed run")


# ===================================================================== 7: SIGTERM to one rank or the group
def sigterm_category(ctx: Context) -> list[Outcome]:
    targets = ["rank 1"] if ctx.quick else ["rank 1", "rank 0", "the whole process group"]
    return [Outcome(f"SIGTERM to {target}", _sigterm_and_resume(ctx, target)) for target in targets]


def _rank_exit_codes(job: Child, record: pathlib.Path) -> dict[int, str]:
    """Each rank's exit code: from torchrun's failure summary where it printed one, else the rank's record."""
    output = job.output()
    summary = dict(re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", output))
    codes = {}
    for rank in (0, 1):
        recorded = pathlib.Path(f"{record}.{rank}")
        if str(rank) in summary:
            codes[rank] = summary[str(rank)]
        elif "Failures:" in output or job.wait() == 0:
            codes[rank] = "0"  # torchrun's summary lists every rank that failed
        else:
            codes[rank] = recorded.read_text() if recorded.exists() else "unknown (it recorded no exit: killed?)"
    return codes


def _sigterm(job: Child, steps: pathlib.Path, target: str) -> bool:
    """Sends SIGTERM to `target` ("rank N" or the whole group); False when the job had already ended."""
    try:
        if target == "the whole process group":
            os.killpg(job.proc.pid, signal.SIGTERM)
        else:
            os.kill(progress(steps, int(target[-1]))[0], signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def _sigterm_and_resume(ctx: Context, target: str) -> list[str]:
    """Sends SIGTERM to `target` once both ranks have trained 2 steps; checks the exit codes and
    checkpoints; then lets a successor resume "latest" and compares it with the reference."""
    run = ctx.folder("sigterm")
    project, steps, go, result, record = (run / "project", run / "progress", run / "go",
                                          run / "resumed.safetensors", run / "exit")
    job = ctx.start(torchrun_args(project, "--epochs", SIGTERM_EPOCHS, "--batch-sleep", 0.05, "--progress", steps,
                                  "--exit-record", record), run / "job.log")
    successor = ctx.start(torchrun_args(project, "--epochs", SIGTERM_EPOCHS, "--resume", "latest", "--seed",
                                        OTHER_SEED, "--wait-for", go, "--result", result), run / "successor.log")
    with killed_after(job, successor):
        if not wait_until(lambda: min(progress(steps, 0)[1], progress(steps, 1)[1]) >= 2, job):
            return [f"the job never reached step 2 on both ranks: it {job.ending()}"]
        if not _sigterm(job, steps, target):
            return [f"the job ended before the SIGTERM, so nothing was tested: it {job.ending()}"]
        job.wait()
        problems = [f"rank {rank} exited {code}, not {PREEMPTION_EXIT_CODE}"
                    for rank, code in _rank_exit_codes(job, record).items() if code != str(PREEMPTION_EXIT_CODE)]
        if job.hung:
            problems.append(f"the job {job.ending()}")
        problems += trainer_checkpoints_broken(project, "after the SIGTERM")
        go.touch()
        return problems + resumed_exactly(ctx, successor, result, "ddp")
