"""Smoke runs of every script in examples/, with tiny sizes, as a newcomer would run them.

Each example runs as `__main__` with its command-line arguments, in its own empty working
folder, and its exit code and output are checked for what shows it did its job. Starting Python,
importing torch and torch's first optimizer (which imports torch._dynamo) take about six CPU
seconds per process, far more than the tiny runs themselves, so the examples do not each get a
process: two subprocesses (this file, run as a script) each run half of them one after the other
with `runpy`, in parallel. Between examples the driver resets what an example may change
globally (working folder, argv, deterministic-algorithms flag).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import traceback

import pytest

pytestmark = pytest.mark.subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Case:
    """One example: its argument lists (run one after the other, in one folder) and what it must print."""

    script: str
    runs: tuple[tuple[str, ...], ...]
    expected: tuple[str, ...]  # regular expressions that must all appear in the combined output
    group: int  # which of the two driver processes runs it; the groups take about equal time


CASES = {
    case.script: case for case in (
        Case("quickstart.py",
             (("--epochs", "1", "--samples", "64"),
              ("--epochs", "2", "--samples", "64", "--resume", "latest")),  # the README's resume command
             (r"epoch 0: val_loss \d", r"epoch 1: val_loss \d", r"checkpoints: outputs/quickstart/checkpoints"),
             0),
        Case("custom_loop.py", (("--smoke",),),
             (r"epoch  0  loss \d", r"weights saved to outputs/custom_loop_smoke/model\.safetensors"), 0),
        Case("distributed.py", (("--smoke",),),
             (r"\[rank 0/1\] NO: \d+ batches", r"done: \d+ optimizer steps on 1 process",
              r"checkpoints in outputs/distributed_smoke/checkpoints"), 0),
        Case("resume.py", (("--smoke",),),
             (r"simulated crash after step", r"final weights equal to the uninterrupted run's \(torch\.equal\): True"),
             1),
        Case("custom_callback.py", (("--smoke",),),
             (r"the checkpoint holds the EMA state: \d+ tensors", r"continued from the checkpoint: True"), 1),
        Case("char_lm.py", (("--smoke",),),
             (r"text: the Zen of Python, \d+ characters", r"sample:\nBeautiful is "), 1),
        Case("gan.py", (("--smoke",),),
             (r"1 process\(es\), \d+ steps, 2 optimizers: g_loss \d", r"distance to the nearest mode: \d",
              r"checkpoints \(both optimizers inside\): outputs/gan_smoke/checkpoints"), 1),
        Case("streaming.py", (("--smoke", "--num-workers", "2"),),
             (r"simulated kill after step \d+", r"step +\d+ +epoch 1 +train_loss \d.* val_loss \d",
              r"final weights equal to the uninterrupted run's \(torch\.equal\): True",
              r"checkpoints: outputs/streaming_smoke/job/checkpoints"), 0),
    )
}


# ----------------------------------------------------------------------------- the driver
def _run_one(script: pathlib.Path, args: list[str], log) -> int:
    """Runs `script` as __main__ with `args`, writing its output to `log`; returns its exit code."""
    import torch

    sys.argv = [str(script), *args]
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        log.write(traceback.format_exc())
        return 1
    finally:
        torch.use_deterministic_algorithms(False)


def drive(jobs: list[dict]) -> None:
    """For each job {"script", "runs", "folder"}: runs it in `folder`, writing output.txt and exit_code."""
    for job in jobs:
        folder = pathlib.Path(job["folder"])
        os.chdir(folder)
        with open(folder / "output.txt", "w") as log:
            code = 0
            for args in job["runs"]:
                log.write(f"$ python examples/{job['script']} {' '.join(args)}\n")
                log.flush()
                code = _run_one(EXAMPLES / job["script"], args, log)
                if code != 0:  # later runs build on earlier ones (quickstart's resume needs its checkpoints)
                    break
        (folder / "exit_code").write_text(str(code))


# ----------------------------------------------------------------------------- the tests
def _run_all(workdir: pathlib.Path) -> None:
    """Runs every example into `workdir/<name>/` (output.txt, exit_code), its groups side by side;
    what a driver printed outside its examples' logs goes to `workdir/drivers.txt`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FITTRAIN_STRATEGY"):
        env.pop(name, None)
    groups: dict[int, list[dict]] = {}
    for script, case in CASES.items():
        folder = workdir / script.removesuffix(".py")
        folder.mkdir()
        groups.setdefault(case.group, []).append({"script": script, "runs": case.runs, "folder": str(folder)})
    drivers = [subprocess.Popen([sys.executable, __file__, json.dumps(jobs)], cwd=workdir, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for jobs in groups.values()]
    crashes = []
    for driver in drivers:
        try:
            output, _ = driver.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            driver.kill()
            output, _ = driver.communicate()
        crashes.append(output)
    (workdir / "drivers.txt").write_text("\n".join(crashes))


def _read_all(workdir: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Each example's (exit code, output) from what `_run_all` wrote (-1: it never finished)."""
    results = {}
    for script in CASES:
        folder = workdir / script.removesuffix(".py")
        log = folder / "output.txt"
        output = log.read_text() if log.exists() else "(never started)\n" + (workdir / "drivers.txt").read_text()
        code_file = folder / "exit_code"
        results[script] = (int(code_file.read_text()) if code_file.exists() else -1, output)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    """Every example's run, made once for all test workers (the tests only read the logs)."""
    from support.shared import shared_folder  # tests/ is not on sys.path where this file drives examples

    return _read_all(shared_folder(tmp_path_factory, "examples", _run_all))


def test_every_example_has_a_smoke_test() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script: str, results: dict[str, tuple[int, str]]) -> None:
    code, output = results[script]
    assert code == 0, f"examples/{script} exited with {code}:\n{output[-3000:]}"
    missing = [pattern for pattern in CASES[script].expected if not re.search(pattern, output)]
    assert not missing, f"examples/{script} did not print {missing}:\n{output[-3000:]}"


if __name__ == "__main__":
    drive(json.loads(sys.argv[1]))


def test_gan_example_runs_on_two_processes(tmp_path: pathlib.Path) -> None:
    """examples/gan.py under torchrun on 2 gloo processes (DDP): manual optimization with two
    optimizers averages each optimizer's gradients across the processes."""
    # Imported here: this file also runs as the examples' driver script, where tests/ is not on sys.path.
    from support.jobs import job_env, run, torchrun

    output = run(torchrun(2, EXAMPLES / "gan.py", "--smoke"), env=job_env(PYTHONWARNINGS="ignore"), timeout=TIMEOUT_S,
                 cwd=tmp_path).check().output
    assert re.search(r"2 process\(es\), \d+ steps, 2 optimizers", output), output[-3000:]
    assert re.search(r"distance to the nearest mode: [\d.]+ before training, [\d.]+ after", output), output[-3000:]


def test_what_the_examples_write_is_ignored_by_git() -> None:
    """The examples write under ./outputs/ (from the checkout's root, as the README runs them)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = sorted({m.group(1) for script in (ROOT / "examples").glob("*.py")
                      for m in re.finditer(r"\"(outputs/[\w/.-]+)\"", script.read_text())})
    assert written, "the examples name no outputs/ folder any more: update this test"
    for path in written:
        probe = f"{path}/model.safetensors"
        done = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT, check=False)
        assert done.returncode == 0, f"{probe} (written by an example) is not ignored by .gitignore"
