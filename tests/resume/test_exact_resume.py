"""An interrupted run, resumed in a fresh process that seeds differently, ends bitwise identical.

The job (scripts/train_job.py) has shuffle, dropout, an LR scheduler whose lr follows its step
count (OneCycleLR), GradClip, an EarlyStop that really stops the run (only at the same epoch if
its counter was restored), gradient accumulation 2, augmentation noise from torch, NumPy and
`random` inside `__getitem__`, and deterministic ops. 40 samples in batches of 4 make 10 batches, so 5
optimizer steps, per epoch (per process); EarlyStop ends the run after epoch 2, at step 15.

- Step 7 is in the middle of epoch 1: its 2nd step, after 4 of its 10 batches.
- Step 10 ends epoch 1: the checkpoint is saved in on_train_batch_end of its last batch, before
  that epoch's validation ran.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fittrain import Accelerator
from resume_support import (
    OTHER_SEED,
    TRAIN_JOB,
    assert_bitwise_equal,
    checkpoint_meta,
    differing,
    forked_train_job,
    load_params,
    load_summary,
)
from support.jobs import Job, forked

pytestmark = pytest.mark.subprocess

BATCHES_PER_EPOCH = 10


def _trace_in(folder) -> dict:
    """The Trace callback's record inside a checkpoint (custom_checkpoint_1.pt holds callback states)."""
    states = torch.load(folder / "custom_checkpoint_1.pt", weights_only=True)
    return next(v for k, v in states.items() if k.endswith(":Trace"))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_and_at_epoch_boundary(tmp_path, resume_references, workers):
    """Fresh processes seeded with 999 resume from a checkpoint in the middle of epoch 1 and from
    one at its end (before its validation), and end exactly as the run that was left alone.

    The checkpoints come from a reference run that saved and ran on to the end; a run that died
    right after the save would have left the same files (a save is closed, fsynced and renamed
    before training goes on; test_kill.py and test_preemption.py do kill the process). That the
    saves did not disturb that run is checked against a reference that never saved.
    """
    resume_references.start()
    saving = f"single_w{workers}_saving"
    mid, boundary = resume_references.checkpoint(saving, 0), resume_references.checkpoint(saving, 1)
    # These import now, and resume once the references (which write the checkpoints) are done.
    common = ("--project", tmp_path / "run", "--workers", workers, "--seed", OTHER_SEED,
              "--wait-for", resume_references.done)
    resumed = [Job(forked_train_job("--resume", mid, "--result", tmp_path / "mid.st", *common)),
               Job(forked_train_job("--resume", boundary, "--result", tmp_path / "boundary.st", *common))]
    try:
        reference = resume_references.get(f"single_w{workers}")
        assert checkpoint_meta(mid)["dataloaders"][0]["epoch"] == 1
        assert checkpoint_meta(mid)["dataloaders"][0]["batches_consumed"] == 4
        # All of epoch 1's batches are consumed but the loader has not closed the epoch yet, and
        # the trace shows that only epoch 0 was validated: the save came before epoch 1's validation.
        assert checkpoint_meta(boundary)["dataloaders"][0]["epoch"] == 1
        assert checkpoint_meta(boundary)["dataloaders"][0]["batches_consumed"] == BATCHES_PER_EPOCH
        assert [epoch for epoch, _ in _trace_in(boundary)["validated"]] == [0]
        assert [step for step, _ in _trace_in(boundary)["losses"]][-1] == 10
        for job in resumed:
            job.wait()
    finally:
        for job in resumed:
            job.kill_group()

    ref_summary = load_summary(reference)
    assert ref_summary["should_stop"] and ref_summary["epoch"] == 3 and ref_summary["global_step"] == 15
    assert_bitwise_equal(resume_references.result(saving), reference)  # saving did not disturb the run
    for name in ("mid", "boundary"):
        assert_bitwise_equal(tmp_path / f"{name}.st", reference)
        # The whole trace matches too: every step's loss, and each epoch validated exactly once.
        summary = load_summary(tmp_path / f"{name}.st")
        assert summary["losses"] == ref_summary["losses"]
        assert summary["validated"] == ref_summary["validated"]


def test_two_processes_resume_mid_epoch(tmp_path):
    """2 gloo processes: a run that saves in the middle of epoch 1 and runs on to the end, and a
    fresh 2-process job resumed from that checkpoint with other seeds, end bitwise identical.

    (That a save does not disturb the run that makes it is shown by the single-process tests,
    whose references never save.)
    """
    project, go = tmp_path / "run", tmp_path / "go"
    checkpoint = project / "checkpoints" / "first" / "checkpoint_0"  # the run named "first"
    # 40 samples, batch 4, 2 ranks: 5 batches per rank per epoch, steps after batches 2, 4 and 5.
    first = Job(forked(2, TRAIN_JOB, "--project", project, "--run-name", "first", "--save-steps", "4",
                         "--result", tmp_path / "uninterrupted.st"))
    resumed = Job(forked(2, TRAIN_JOB, "--project", project, "--resume", checkpoint, "--seed", OTHER_SEED,
                           "--wait-for", go, "--result", tmp_path / "resumed.st"))
    try:
        first.wait()
        meta = checkpoint_meta(checkpoint)
        assert meta["num_processes"] == 2 and meta["dataloaders"][0]["batches_consumed"] == 2
        assert (checkpoint / "random_states_0.pt").is_file() and (checkpoint / "random_states_1.pt").is_file()
        go.touch()
        resumed.wait()
    finally:
        first.kill_group()
        resumed.kill_group()
    assert_bitwise_equal(tmp_path / "resumed.st", tmp_path / "uninterrupted.st")
    assert load_summary(tmp_path / "resumed.st")["losses"] == load_summary(tmp_path / "uninterrupted.st")["losses"]


class _NoiseOnly(Dataset):
    """Each item is fresh noise from torch, NumPy and Python's random module, plus its index."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()],
                            dtype=torch.float64)


def _loader(workers: int) -> DataLoader:
    return DataLoader(_NoiseOnly(), batch_size=4, shuffle=True, num_workers=workers)


def test_worker_augmentation_is_a_function_of_seed_epoch_and_batch():
    """Under DataLoader workers, `__getitem__` randomness is reseeded per batch from (the pass's
    base seed, epoch, batch number): a fresh loader, another global seed and skipped batches change
    nothing once the checkpointed state (the loader's state and the RNG) is restored."""
    torch.manual_seed(0)
    dl = Accelerator().prepare(_loader(workers=2))
    epoch0 = []
    for batch in dl:
        epoch0.append(batch.clone())
        if len(epoch0) == 3:
            state, rng = dl.state_dict(), torch.get_rng_state()  # what save_state keeps
    epoch1 = [b.clone() for b in dl]

    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    acc = Accelerator()
    resumed = acc.prepare(_loader(workers=2))
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # load_state restores the RNG last
    tail = [b.clone() for b in acc.skip_first_batches(resumed, 3)]
    assert len(tail) == len(epoch0) - 3
    for got, want in zip(tail, epoch0[3:]):
        assert torch.equal(got, want)
    assert torch.equal(torch.cat([b.clone() for b in resumed]), torch.cat(epoch1))  # then epoch 1, exactly

    noise = torch.cat(epoch0 + epoch1)[:, 1:]
    for column in noise.T:  # each of torch, numpy and random really varies: no batch repeats another's draws
        assert len(set(column.tolist())) == len(column)


SABOTAGES = {
    "nothing": None,  # the control: this in-process resume must match, so the others' failures mean something
    "rng": ("fittrain.checkpoint.restore.restore_rng_state", lambda state: None),
    "data position": ("fittrain.data.map_style.DataLoaderShard.load_state_dict", lambda self, state: None),
    "callback states": ("fittrain.trainer.callback_states.CallbackStates.load_state_dict", lambda self, state: None),
}


@pytest.mark.parametrize("sabotage", sorted(SABOTAGES))
def test_the_comparison_catches_a_resume_that_forgets_something(resume_references, train_job_module, monkeypatch,
                                                               deterministic, tmp_path, sabotage):
    """Resumes in this process from the mid-epoch checkpoint with one piece of state not restored:
    the final parameters must differ from the uninterrupted run (and match it when nothing is left
    out), so the bitwise comparisons above can fail."""
    reference = resume_references.get("single_w0")
    if SABOTAGES[sabotage]:
        monkeypatch.setattr(*SABOTAGES[sabotage])
    job = train_job_module
    checkpoint = resume_references.checkpoint("single_w0_saving", 1 if sabotage == "callback states" else 0)
    trainer, module, train, val = job.build(job.parse_args(
        ["--project", str(tmp_path), "--resume", str(checkpoint), "--seed", OTHER_SEED]))
    trainer.fit(module, train, val)
    bad = differing({k: v.detach() for k, v in module.state_dict().items()}, load_params(reference))
    assert bool(bad) == (sabotage != "nothing"), f"{sabotage}: differing tensors {bad}"
