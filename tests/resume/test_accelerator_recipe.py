"""The plain-loop recipe: `load_state` + `skip_first_batches(dl, dl.position.batches_consumed)`
continues an interrupted hand-written Accelerator loop bitwise exactly (docs/resume.md)."""

from __future__ import annotations

import pytest

from resume_support import OTHER_SEED, checkpoint_meta, differing, load_params
from support.jobs import Job, python_script

pytestmark = pytest.mark.subprocess


def plain_loop(*args) -> list[str]:
    return python_script("plain_loop.py", *args)


def test_plain_loop_resumes_mid_epoch_exactly(tmp_path, resume_references):
    resume_references.start()
    # A fresh process, seeded differently, that imports now and resumes once the references are done.
    resumed = Job(plain_loop("--resume", resume_references.plain_checkpoint, "--seed", OTHER_SEED,
                             "--wait-for", resume_references.done, "--result", tmp_path / "resumed.st"))
    try:
        reference = resume_references.get("plain")
        # Step 7 is the 2nd of epoch 1's 5 steps (10 batches, accumulation 2): 4 batches consumed.
        position = checkpoint_meta(resume_references.plain_checkpoint)["dataloaders"][0]
        assert (position["epoch"], position["batches_consumed"]) == (1, 4)
        resumed.wait()
    finally:
        resumed.kill_group()
    assert not differing(load_params(resume_references.result("plain_saving")), load_params(reference)), \
        "saving changed the run that saved"
    bad = differing(load_params(tmp_path / "resumed.st"), load_params(reference))
    assert not bad, f"parameters differ bitwise in {bad}"
