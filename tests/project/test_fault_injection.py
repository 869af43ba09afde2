"""Smoke runs of `python -m benchmarks.fault_injection --quick`: real faults, a few per category.

The script (see its docstring) kills, damages, fills and signals checkpoints with real processes
and files, and prints `survived/tried` per category and in total. These tests check the script's
contract: it exits 0, prints the total line, and every scenario it tried survived. The last
assertion is the point: while fittrain breaks one of its checkpoint promises, the test fails and
shows the script's FAIL lines. They run twice: the single-process categories (about twenty
Python processes, a minute on 2 cores) and the sharded ones, whose scenarios run on 2 ranks of an
FSDP2 job (gloo, CPU): one job that builds a sharded project once and attacks copies of it, and
one sharded save killed and checked (about a minute). Both are marked `slow`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a guard against a hang: a busy 2-core machine with 4 test workers took 160 s
TOTAL = re.compile(r"^total: (\d+)/(\d+) survived", re.MULTILINE)
#: Categories of each run, and how many scenarios they run wherever the tests run (disk-full needs
#: root and tmpfs; the sharded-files job attacks each kind of sharded file, see sharded_files.QUICK).
RUNS = {
    "single-process": (
        ("kill-sync", "kill-async", "disk-full", "damaged", "hostile", "two-writers", "sigterm-rank"), 6),
    "sharded": (("sharded-kill", "sharded-files"), 10),
}
#: Marks the script and every process it starts (torchrun's workers live in sessions of their own).
_MARK = "FITTRAIN_FAULT_INJECTION_TEST"


def _kill_marked(mark: str) -> None:
    """SIGKILLs every live process whose environment carries `mark` (Linux's /proc)."""
    wanted = f"{_MARK}={mark}".encode()
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)


def run_quick(categories: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Runs the script with --quick on `categories` from the repository root; on a timeout, stops it
    and fails. Nothing it started outlives it."""
    command = [sys.executable, "-m", "benchmarks.fault_injection", "--quick",
               *(arg for category in categories for arg in ("--only", category))]
    mark = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{_MARK: mark})
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the script then kills its own children and unmounts its tmpfs.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"`{' '.join(command[1:])}` ran past {TIMEOUT_S} s.\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        _kill_marked(mark)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_fault_injection_quick_every_scenario_survives(run: str) -> None:
    categories, always_run = RUNS[run]
    done = run_quick(categories)
    assert done.returncode == 0, (f"the script exited {done.returncode}.\nstdout:\n{done.stdout[-3000:]}\n"
                                  f"stderr:\n{done.stderr[-3000:]}")
    match = TOTAL.search(done.stdout)
    assert match, f"no 'total: N/M survived' line:\n{done.stdout[-3000:]}"
    survived, tried = map(int, match.groups())
    assert tried >= always_run, f"only {tried} scenarios ran:\n{done.stdout}"
    failed = "\n".join(line for line in done.stdout.splitlines() if line.lstrip().startswith("FAIL"))
    assert survived == tried, f"{tried - survived} of {tried} fault scenarios failed:\n{failed}\n\n{done.stdout}"
