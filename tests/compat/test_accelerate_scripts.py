"""Hugging Face Accelerate's own test scripts, ported to fittrain, on 1 and 2 gloo processes.

The scripts in tests/compat/accelerate_scripts/ are Accelerate 1.15.0's `test_utils/scripts/test_ops.py`,
`test_sync.py`, `test_script.py`, `test_distributed_data_loop.py` and
`external_deps/test_metrics.py` with their imports changed from `accelerate` to `fittrain` and
nothing else, except checks that cannot apply on fittrain (GPU/TPU-only paths, Accelerate's
internal classes and singletons), each removed where it stood with a comment saying why, and
listed in the script's docstring. Their expected values and assertions are Accelerate's. Beside
them, example_regression.py is a training script written for Accelerate (checkpoints with
automatic naming, resume mid-epoch, gather_for_metrics, trackers), converted the same way.

Each script runs as a real multi-process job with torchrun's environment (its ranks forked from a
process with torch imported: tests/support/ranks.py), on 1 process and on 2 CPU processes (gloo),
and must exit 0. test_distributed_data_loop.py runs on 2 only: the script
asserts 2 processes itself. A job runs in a temporary working directory (test_script.py writes a
file into it), gets a deadline, and is killed with its whole process group when it overruns.

Every script passes on fittrain today. Should a future gap appear (a script that cannot pass
because fittrain lacks a name or differs from Accelerate), add it to `GAPS`: the script is then
marked `xfail(strict=True)` with the gap in its reason, so the gap stays visible, and the marker
must go when the gap is closed (a strict xfail that passes fails the suite).
"""

from __future__ import annotations

import pathlib

import pytest

from support.jobs import forked, run

pytestmark = pytest.mark.subprocess

SCRIPTS = pathlib.Path(__file__).parent / "accelerate_scripts"
#: Longest one job may run; the scripts take seconds, but the machine may be shared.
TIMEOUT = 180.0


def run_script(nproc: int, script: str, cwd: pathlib.Path, *args: str) -> str:
    """Runs tests/compat/accelerate_scripts/`script` on `nproc` ranks with torchrun's environment (forked,
    see support.jobs.forked), in `cwd`, and fails the test with the tail of its output unless it exits 0;
    returns the output."""
    return run(forked(nproc, SCRIPTS / script, *args, cwd=cwd), timeout=TIMEOUT).check().output


#: Lines no job may print: a check the script skipped (Accelerate's own skip message).
SKIPPED_OUTPUT = ("Skipped because Hugging Face datasets is not available",)


def assert_printed(output: str, lines: tuple[str, ...]) -> None:
    """Fails with the tail of `output` unless every one of `lines`, and none of SKIPPED_OUTPUT, is in it."""
    missing = [line for line in lines if line not in output]
    assert not missing, f"the job exited 0 but never printed {missing}, so these checks did not run:\n{output[-3000:]}"
    skipped = [line for line in SKIPPED_OUTPUT if line in output]
    assert not skipped, f"the job skipped a check: {skipped}\n{output[-3000:]}"


_SCRIPT_LINES = ("**Test process execution**", "**Test split between processes as a datasets.Dataset**",
                 "All rng are properly synched.", "Non-shuffled dataloader passing.", "Shuffled dataloader passing.",
                 "Training yielded the same results on one CPU or distributed setup with no batch split.",
                 "Training yielded the same results on one CPU or distributed setup with batch split.",
                 "BF16 training check.", "FP16 training check.", "**Breakpoint trigger test**")
_METRICS_LINES = ("**Test torch metrics**", "With: `split_batches=True`, `dispatch_batches=False`, length=99",
                  "With: `split_batches=False`, `dispatch_batches=False`, length=99",
                  "**Test that `drop_last` is taken into account**")


def _gap(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


# Why a script does not pass on fittrain (none today; see the docstring of this module).
GAPS: dict[tuple[str, int], str] = {}

#: Lines each job must print, so that a check skipped because fittrain answers one of the scripts'
#: conditions differently (a `distributed_type` that is not a value, say) cannot pass unnoticed.
EXPECTED_OUTPUT: dict[tuple[str, int], tuple[str, ...]] = {
    ("test_ops.py", 1): ("testing op_checker",),
    ("test_ops.py", 2): ("testing op_checker",),
    ("test_sync.py", 1): ("**Test NOOP `no_sync` context manager**",
                          "**Test `accumulate` gradient accumulation with optimizer and scheduler, "),
    ("test_sync.py", 2): ("**Test Distributed `no_sync` context manager**",
                          "**Test Distributed `no_sync` context manager with multiple forwards**",
                          "**Test `accumulate` gradient accumulation with optimizer and scheduler, "),
    ("test_script.py", 1): _SCRIPT_LINES,
    ("test_script.py", 2): _SCRIPT_LINES,
    ("test_metrics.py", 1): _METRICS_LINES,
    ("test_metrics.py", 2): _METRICS_LINES,
    ("test_distributed_data_loop.py", 2): ("Test DataLoader with sampler as an instance of `BatchSampler`",),
}

SCRIPT_RUNS = [(script, nproc) for script in ("test_ops.py", "test_sync.py", "test_script.py", "test_metrics.py")
               for nproc in (1, 2)] + [("test_distributed_data_loop.py", 2)]


@pytest.mark.parametrize(
    "script, nproc",
    [pytest.param(script, nproc, id=f"{script[:-3]}-{nproc}proc",
                  marks=[_gap(GAPS[script, nproc])] if (script, nproc) in GAPS else [])
     for script, nproc in SCRIPT_RUNS])
def test_accelerate_script_passes_on_fittrain(script: str, nproc: int, tmp_path: pathlib.Path) -> None:
    assert_printed(run_script(nproc, script, tmp_path), EXPECTED_OUTPUT[script, nproc])


EXAMPLE_GAPS: dict[int, str] = {}


@pytest.mark.parametrize(
    "nproc", [pytest.param(n, id=f"{n}proc", marks=[_gap(EXAMPLE_GAPS[n])] if n in EXAMPLE_GAPS else [])
              for n in (1, 2)])
def test_accelerate_style_example_resumes_to_the_uninterrupted_weights(nproc: int, tmp_path: pathlib.Path) -> None:
    """example_regression.py: the resumed run must end with the uninterrupted run's exact weights."""
    output = run_script(nproc, "example_regression.py", tmp_path, "--project_dir", str(tmp_path / "project"),
                        "--log_with", "tensorboard")
    assert_printed(output, ("Resuming from ", "example_regression OK"))
