"""Smoke run of `python -m benchmarks.fault_injection --quick`: one real fault per category.

The script (see its docstring) kills, damages, fills and signals checkpoints with real processes
and files, and prints `survived/tried` per category and in total. This test checks the script's
contract: it exits 0, prints the total line, and every scenario it tried survived. The last
assertion is the point of the test: while fittrain breaks one of its checkpoint promises, it fails
and shows the script's FAIL lines. It starts about twenty Python processes (most of the time is
importing torch), about a minute on 2 cores, so it is marked `slow`.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
#: Categories that run a scenario wherever the tests run (disk-full needs root and tmpfs).
ALWAYS_RUN = 6
TOTAL = re.compile(r"^total: (\d+)/(\d+) survived", re.MULTILINE)


def run_quick() -> subprocess.CompletedProcess:
    """Runs the script with --quick from the repository root; on a timeout, stops it and fails."""
    command = [sys.executable, "-m", "benchmarks.fault_injection", "--quick"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


@pytest.mark.slow
def test_fault_injection_quick_every_scenario_survives() -> None:
    done = run_quick()
    assert done.returncode == 0, (f"the script exited {done.returncode}.\nstdout:\n{done.stdout[-3000:]}\n"
                                  f"stderr:\n{done.stderr[-3000:]}")
    match = TOTAL.search(done.stdout)
    assert match, f"no 'total: N/M survived' line:\n{done.stdout[-3000:]}"
    survived, tried = map(int, match.groups())
    assert tried >= ALWAYS_RUN, f"only {tried} scenarios ran:\n{done.stdout}"
    failed = "\n".join(line for line in done.stdout.splitlines() if line.lstrip().startswith("FAIL"))
    assert survived == tried, f"{tried - survived} of {tried} fault scenarios failed:\n{failed}\n\n{done.stdout}"
