"""Smoke runs of every benchmark in benchmarks/, with the smallest settings their flags allow.

Each benchmark runs as `python -m benchmarks.<name>` from the repository root, as the README
says, in its own process: several start processes of their own (memory, ddp), and all of them
set process-wide torch state. A run passes when it exits with 0 and prints its table with at
least one row that holds a ratio (and, where a case names rows, each of them with a finite
ratio: the overhead rows of the batch_size=None and IterableDataset modes, and its workers row).
These tests check that the benchmarks still work end to end, not what they measure: at these
sizes the numbers are noise.

Most of each run's time is starting Python and importing torch (and, for the first optimizer,
torch._dynamo), once per process. The memory benchmark starts one fresh process per loop (with
`--smoke` each trains a tiny MLP), so it is marked `slow`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a guard against a hang: a busy 2-core machine with 4 test workers took 160 s

# A table row that holds a ratio such as "0.981×" or "1.05x": a markdown row ("| ... |"), or a
# plain-text row whose ratio sits beside at least two other numbers.
RATIO = r"\d+\.\d+ ?[×x](?![\w])"
MARKDOWN_ROW = re.compile(rf"^\|.*{RATIO}.*\|\s*$", re.MULTILINE)
NUMBER = re.compile(r"\d+\.\d+|\d+")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark: its tiny arguments and the table format it prints."""

    module: str
    args: tuple[str, ...]
    markdown: bool  # a markdown table with "×"; otherwise a plain-text table with a ratio column
    # Markdown rows that must be there, by their first cells ("loop | batches"), each with a finite ratio.
    rows: tuple[str, ...] = ()


LOADER_ROWS = tuple(f"{loop} | {batches}" for batches in ("batch_size=None", "IterableDataset")
                    for loop in ("fittrain Accelerator loop", "fittrain Trainer.fit, no callbacks"))

CASES = [
    pytest.param(Case("overhead", ("--steps", "20", "--repeats", "1"), True, LOADER_ROWS), id="overhead"),
    pytest.param(Case("overhead", ("--workers-row", "--steps", "20", "--repeats", "1"), True,
                      ("fittrain Trainer.fit, no callbacks",)), id="overhead-workers-row"),
    pytest.param(Case("memory", ("--smoke",), True), id="memory", marks=pytest.mark.slow),
    pytest.param(Case("checkpoint", ("--mb", "8", "--repeats", "1"), False), id="checkpoint"),
    pytest.param(Case("checkpoint", ("--fsdp-table", "--sizes", "1", "--processes", "2", "--rounds", "1"), True,
                      ("1 | 2",)), id="checkpoint-fsdp-table"),
    pytest.param(Case("ddp", ("--steps", "4", "--rounds", "1"), False), id="ddp"),
    pytest.param(Case("layouts", ("--smoke",), True, ("DDP", "FSDP2", "HSDP", "TP", "FSDP2+TP")), id="layouts"),
    pytest.param(Case("fault_tolerance", ("--scenarios", "worker", "--steps", "60", "--every", "10", "--kill-at",
                                          "30"), True, ("worker killed",)), id="fault_tolerance"),
    pytest.param(Case("gpu", ("--device", "cpu", "--quick"), True), id="gpu-on-cpu"),
    pytest.param(Case("compile", ("--smoke",), True, ("Trainer, compiled",)), id="compile"),
    pytest.param(Case("startup", ("--rounds", "1", "--warmup", "0", "--steps", "2", "--explain", "always"), True,
                      ("import fittrain, Trainer.fit | wall", "import fittrain, Trainer.fit | cpu")), id="startup"),
]


def run_benchmark(module: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `python -m benchmarks.<module> args...` from the repository root and returns the result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", f"benchmarks.{module}", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, (f"`{' '.join(command[1:])}` exited with {done.returncode}.\n"
                                  f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return done


def ratio_rows(output: str, markdown: bool) -> list[str]:
    """The table rows of `output` that hold a ratio."""
    if markdown:
        return MARKDOWN_ROW.findall(output)
    return [line for line in output.splitlines()
            if re.search(RATIO, line) and len(NUMBER.findall(line)) >= 3]


def first_ratio(output: str, row: str) -> float | None:
    """The first ratio cell ("1.234×") of the markdown row whose first cells are `row`, or None."""
    for line in output.splitlines():
        if line.startswith(f"| {row} |"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            ratios = [cell[:-1] for cell in cells if re.fullmatch(r"(\d+\.\d+|nan|inf)×", cell)]
            return float(ratios[0]) if ratios else None
    return None


@pytest.mark.parametrize("case", CASES)
def test_benchmark_runs_and_prints_its_table(case: Case) -> None:
    done = run_benchmark(case.module, *case.args)
    rows = ratio_rows(done.stdout, case.markdown)
    assert rows, (f"benchmarks.{case.module} printed no table row with a ratio "
                  f"({'markdown' if case.markdown else 'plain text'}):\n{done.stdout[-3000:]}")
    if case.markdown:
        assert "×" in done.stdout
    for row in case.rows:
        ratio = first_ratio(done.stdout, row)
        assert ratio is not None and math.isfinite(ratio), (
            f"benchmarks.{case.module} {' '.join(case.args)} printed no finite ratio in row {row!r}:\n"
            f"{done.stdout[-3000:]}")


def test_gpu_benchmark_without_cuda_says_so_and_exits_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU (and without --device cpu) the gpu benchmark prints one line and runs nothing."""
    monkeypatch.syspath_prepend(str(ROOT))  # `pytest` alone does not put the repository root on sys.path
    from benchmarks import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = gpu.main([])
    assert out.getvalue().strip() == report == gpu.NO_CUDA
    assert report.startswith("no CUDA device: the gpu benchmark needs one;")
    assert "\n" not in report


def test_exit_stress_runs_a_two_process_job_that_exits_cleanly() -> None:
    """The exit stress script (20 runs beside busy processes by default) with one run and no load."""
    done = run_benchmark("exit_stress", "--runs", "1", "--load", "0")
    assert done.stdout.strip().splitlines()[-1].startswith("exit_stress: 1/1 runs exited 0"), done.stdout
