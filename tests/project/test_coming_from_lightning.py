"""docs/coming_from_lightning.md's programs run, and report what the page says.

The page shows one Lightning program, the import change that ports it to `fittrain.lightning` (a
```diff block), and the same program on the native API. Each runs here as a script in a fresh
interpreter: the Lightning program on Lightning itself, the same program with exactly the diff's
lines changed on fittrain.lightning, and the native program. All three must end with the same
best checkpoint name and the same test accuracy: they train the
same float32 steps on the same batches (same seed, same shuffle), so they agree exactly; a
relative 1e-6 leaves room only for how a mean is summed, far below what one more or one fewer
step, batch or shuffle changes (1e-2 here, on a 96-sample test set).
"""

from __future__ import annotations

import ast
import math
import pathlib
import re
import sys

import pytest

from support.jobs import Job

pytestmark = pytest.mark.subprocess

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "coming_from_lightning.md"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
TIMEOUT = 180.0  # a job imports torch and Lightning (or fittrain) and trains for a few seconds


def _blocks(kind: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(PAGE.read_text(encoding="utf-8")) if m.group(1) == kind]


def ported(program: str, diff: str) -> str:
    """`program` with each `-` line of `diff` replaced by the `+` line in its place (nothing else)."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    assert removed and len(removed) == len(added), "the diff block pairs each removed line with an added one"
    lines = program.splitlines()
    for old, new in zip(removed, added):
        assert lines.count(old) == 1, f"the program has no single line {old!r} for the diff to change"
        lines[lines.index(old)] = new
    return "\n".join(lines) + "\n"


def outcome(output: str) -> tuple[str, float]:
    """(the best checkpoint's name, the test accuracy) from what a program printed."""
    best = re.search(r"^best checkpoint: (.+)$", output, re.MULTILINE)
    test = re.search(r"^test: (.+)$", output, re.MULTILINE)
    assert best and test, f"the program did not print its results:\n{output[-3000:]}"
    results = ast.literal_eval(test.group(1))
    metrics = results[0] if isinstance(results, list) else results  # Lightning returns one dict per loader
    return pathlib.PurePath(best.group(1).strip()).name, metrics["test_acc"]


def test_the_page_ports_by_the_import_change_and_natively_to_the_same_results(tmp_path):
    program, native = _blocks("python")
    (diff,) = _blocks("diff")
    jobs = {}
    try:
        for name, source in (("lightning", program), ("fittrain.lightning", ported(program, diff)), ("native", native)):
            folder = tmp_path / name
            folder.mkdir()
            (folder / "classifier.py").write_text(source, encoding="utf-8")
            jobs[name] = Job([sys.executable, "classifier.py"], timeout=TIMEOUT, cwd=folder)  # side by side
        results = {name: outcome(job.wait(expect=None).check().output) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill_group()
    lightning_best, lightning_acc = results["lightning"]
    assert lightning_acc > 0.6, "the page's program should learn something (three classes: chance is 1/3)"
    for name in ("fittrain.lightning", "native"):
        best, acc = results[name]
        assert math.isclose(acc, lightning_acc, rel_tol=1e-6), (name, results)
    assert results["fittrain.lightning"][0] == lightning_best  # the same template, epoch and score (a .ckpt folder)
    assert re.fullmatch(r"checkpoint_\d+", results["native"][0])  # the native names count saves
    shown = re.search(r"^test: (.+)$", _blocks("text")[0], re.MULTILINE).group(1)
    assert ast.literal_eval(shown)[0]["test_acc"] == pytest.approx(lightning_acc, rel=1e-6), \
        "the page shows another test accuracy than its program reaches"
    assert f"checkpoints/{lightning_best}\n" in _blocks("text")[0], "the page shows another best checkpoint"
