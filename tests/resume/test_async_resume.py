"""Checkpointer(async_save=True): a run resumed from a checkpoint written in the background, in a
fresh process that seeds differently, ends bitwise identical to the uninterrupted run.

The job is scripts/train_job.py (see test_exact_resume.py for what it switches on). Here the
uninterrupted reference and the saving run train in this process, with one thread like the jobs;
the saving run writes each checkpoint on a background thread, slowed down so that training
really goes on (and mutates every tensor in place) while the files are written.
"""

from __future__ import annotations

import time

import pytest
import torch

from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import list_checkpoints
from fittrain.checkpoint import snapshot as snapshot_module
from resume_support import OTHER_SEED, differing, forked_train_job, load_params, load_summary
from support.jobs import Job

pytestmark = pytest.mark.subprocess


@pytest.fixture
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _fit(job, argv: list[str], extra=()) -> dict[str, torch.Tensor]:
    trainer, module, train, val = job.build(job.parse_args(argv), extra)
    trainer.fit(module, train, val)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_resume_from_an_async_checkpoint_is_exact(tmp_path, train_job_module, deterministic, one_thread,
                                                  monkeypatch):
    job = train_job_module
    project = tmp_path / "saving"
    checkpoint_7 = project / "checkpoints" / "saving" / "checkpoint_0"  # the run named "saving"
    # Importing torch is most of a job's cost: start the resumed job now; it trains once `go` exists.
    go = tmp_path / "go"
    resumed = Job(forked_train_job("--project", tmp_path / "resumed", "--resume", checkpoint_7, "--seed", OTHER_SEED,
                            "--wait-for", go, "--result", tmp_path / "resumed.st"))
    try:
        reference = _fit(job, ["--project", str(tmp_path / "reference")])

        original = snapshot_module.write_snapshot

        def slow(writer, snapshot):  # type: ignore[no-untyped-def]
            time.sleep(0.2)  # a few batches train meanwhile
            original(writer, snapshot)

        monkeypatch.setattr(snapshot_module, "write_snapshot", slow)
        # Saves at steps 7 (mid-epoch 1) and 14; the run goes on to step 15 while they are written.
        saving = _fit(job, ["--project", str(project), "--run-name", "saving"],
                      extra=(Checkpointer(every_n_steps=7, async_save=True),))
        assert not differing(saving, reference), "saving in the background disturbed the run"
        assert [p.name for p in list_checkpoints(checkpoint_7.parent)] == ["checkpoint_0", "checkpoint_1"]
        go.touch()
        resumed.wait()
    finally:
        resumed.kill_group()
    bad = differing(load_params(tmp_path / "resumed.st"), reference)
    assert not bad, f"the resumed run differs in {bad}"
    assert load_summary(tmp_path / "resumed.st")["global_step"] == 15
