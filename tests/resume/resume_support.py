"""What the exact-resume suite adds to support/jobs.py: its training job, references, bitwise comparisons.

Every run that matters happens in a fresh Python process (scripts/train_job.py or
scripts/plain_loop.py in tests/support/scripts/, started or forked through support.jobs). A
resumed process seeds every RNG with 999 instead of 0 before it builds anything, so whatever a
checkpoint fails to restore changes the final parameters. Independent jobs run side by side (the
machine has few cores and each job spends most of its time importing torch).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import safetensors.torch
import torch

from support.jobs import SCRIPTS, Job, Ranks, forked_process, job_env, python_script

TRAIN_JOB = SCRIPTS / "train_job.py"
#: The seed of a resumed process: anything not restored from the checkpoint then differs.
OTHER_SEED = "999"


def train_job(*args: Any) -> list[str]:
    """The command line of scripts/train_job.py in a fresh interpreter."""
    return python_script(TRAIN_JOB, *args)


def forked_train_job(*args: Any) -> Ranks:
    """scripts/train_job.py as a fresh single process, forked (see support.jobs.forked_process)."""
    return forked_process(TRAIN_JOB, *args)


def load_params(path: pathlib.Path | str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def load_summary(path: pathlib.Path | str) -> dict[str, Any]:
    return json.loads(pathlib.Path(f"{path}.json").read_text())


def differing(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that are not bitwise equal (all names when the keys differ)."""
    if sorted(actual) != sorted(expected):
        return sorted(set(actual) | set(expected))
    return [k for k in expected if not torch.equal(actual[k], expected[k])]


def assert_bitwise_equal(result: pathlib.Path, reference: pathlib.Path) -> None:
    """The run that wrote `result` ended with exactly the parameters of the one that wrote `reference`."""
    bad = differing(load_params(result), load_params(reference))
    if bad:
        got, want = load_summary(result), load_summary(reference)
        pytest.fail(f"parameters differ bitwise in {bad}.\nresumed run: {got}\nreference:   {want}")
    assert load_summary(result)["global_step"] == load_summary(reference)["global_step"]


def checkpoint_meta(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "accelerator_state.json").read_text())


class References:
    """Uninterrupted runs, computed once per session by one background process (scripts/references.py).

    References never resume, so they need no fresh process; one process for all of them pays
    for importing torch once. Each configuration runs twice: without any checkpointing, and
    with saves (whose checkpoints the resume tests start from) while running on to the end.
    `done` appears when all have finished, so a test can start its resumed jobs early and let
    them wait for it (`--wait-for`).
    """

    SAVE_STEPS = "7,10"  # mid-epoch 1, and the end of epoch 1 before its validation
    PLAIN_SAVE_STEP = 7

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.done = root / "done"
        self.job: Job | None = None

    def _runs(self) -> list[list[Any]]:
        runs: list[list[Any]] = []
        for workers in (0, 2):
            for name, extra in ((f"single_w{workers}", ()),
                                (f"single_w{workers}_saving", ("--save-steps", self.SAVE_STEPS))):
                runs.append(["train", "--project", self.root / name, "--run-name", name, "--result",
                             self.result(name), "--workers", workers, *extra])
        runs.append(["train", "--project", self.root / "stream_w2", "--result", self.result("stream_w2"),
                     "--stream", "--workers", 2])
        runs.append(["plain", "--result", self.result("plain")])
        runs.append(["plain", "--result", self.result("plain_saving"), "--checkpoint", self.plain_checkpoint,
                     "--save-at-step", self.PLAIN_SAVE_STEP])
        return runs

    @property
    def plain_checkpoint(self) -> pathlib.Path:
        return self.root / "plain_checkpoint"

    def checkpoint(self, name: str, index: int) -> pathlib.Path:
        return self.root / name / "checkpoints" / name / f"checkpoint_{index}"  # the run is named like its project

    def start(self) -> None:
        if self.job is None:
            args: list[Any] = [SCRIPTS / "references.py", self.done]
            for run in self._runs():
                args += [*run, "--then"]
            # Marked as a process that outlives the test that starts it (tests/conftest.py's guard).
            self.job = Job(python_script(*args[:-1]), env={**job_env(), "FITTRAIN_TEST_SESSION_PROCESS": "1"})
            Job.open_jobs.remove(self.job)  # shared by the session: not a test's leftover; its fixture stops it

    def result(self, name: str) -> pathlib.Path:
        return self.root / f"{name}.safetensors"

    def get(self, name: str) -> pathlib.Path:
        self.start()
        if self.job.finished is None:
            self.job.wait()
        return self.result(name)
