"""The plain-loop recipe: `load_state` + `skip_first_batches(dl, dl.position.batches_consumed)`
continues an interrupted hand-written Accelerator loop bitwise exactly (docs/resume.md)."""

from __future__ import annotations

import sys

from resume_jobs import OTHER_SEED, SCRIPTS, Job, checkpoint_meta, differing, load_params

PLAIN_LOOP = SCRIPTS / "plain_loop.py"


def plain_loop(*args) -> list[str]:
    return [sys.executable, str(PLAIN_LOOP), *map(str, args)]


def test_plain_loop_resumes_mid_epoch_exactly(tmp_path, references):
    references.start()
    # A fresh process, seeded differently, that imports now and resumes once the references are done.
    resumed = Job(plain_loop("--resume", references.plain_checkpoint, "--seed", OTHER_SEED,
                             "--wait-for", references.done, "--result", tmp_path / "resumed.st"))
    try:
        reference = references.get("plain")
        # Step 7 is the 2nd of epoch 1's 5 steps (10 batches, accumulation 2): 4 batches consumed.
        position = checkpoint_meta(references.plain_checkpoint)["dataloaders"][0]
        assert (position["epoch"], position["batches_consumed"]) == (1, 4)
        resumed.wait()
    finally:
        resumed.kill_group()
    assert not differing(load_params(references.result("plain_saving")), load_params(reference)), \
        "saving changed the run that saved"
    bad = differing(load_params(tmp_path / "resumed.st"), load_params(reference))
    assert not bad, f"parameters differ bitwise in {bad}"
