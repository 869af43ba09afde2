"""Sharded checkpoints (torch.distributed.checkpoint) under FSDP2 on 2 and 4 real gloo processes.

Each rank writes its own shards; a resume is bitwise; an asynchronous sharded save killed in the
middle leaves the previous checkpoint "latest" and intact; a damaged shard is named on every rank
and passed over for the previous checkpoint; a rank whose disk fills mid-save fails the save on
every rank with that rank's OSError, and the same save then succeeds (scripts/sharded_worker.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
import torch
from safetensors.torch import load_file

from fittrain.checkpoint import MANIFEST_NAME, is_intact, list_checkpoints
from fittrain.checkpoint.consolidate import consolidate
from support.jobs import JOB_TIMEOUT, Job, forked, run, torchrun
from support.results import assert_state_equal

pytestmark = pytest.mark.subprocess


def _ranks(out: pathlib.Path, prefix: str, n: int) -> list[dict]:
    return [json.loads((out / f"{prefix}{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_rank_writes_its_own_shards_and_a_resume_is_bitwise(tmp_path: pathlib.Path, nproc: int) -> None:
    run(forked(nproc, "sharded_worker.py", "resume", "--out", str(tmp_path))).check()
    ranks = _ranks(tmp_path, "rank", nproc)
    assert all(rank["equal"] and rank["resumed_at"] == 3 and rank["default_type"] == "sharded" for rank in ranks)
    folder = tmp_path / "project" / "checkpoints" / "checkpoint_0"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    shards = [f"shards/__{r}_0.distcp" for r in range(nproc)]
    assert set(shards) <= set(files)
    # No full-state files: nothing was gathered.
    assert not [f for f in files if f.startswith(("model", "optimizer"))]
    manifest = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    assert set(files) - {MANIFEST_NAME} == set(manifest)
    # Each rank's file holds its shard of the model and of AdamW's two moments (x3), plus a
    # small header per tensor and the replicated step counters (~50 kB): not the whole model.
    total = sum(rank["local_bytes"] for rank in ranks)
    for r, rank in enumerate(ranks):
        size = (folder / shards[r]).stat().st_size
        assert 3 * rank["local_bytes"] <= size < 3 * rank["local_bytes"] + 50_000, (r, size, rank["local_bytes"])
        assert size < 0.75 * 3 * total
    final = torch.load(tmp_path / "final_resume.pt")
    assert_state_equal(final, torch.load(tmp_path / "final_uninterrupted.pt"))
    # save_model streamed the sharded weights into Hugging Face's layout, readable with safetensors alone.
    index = json.loads((tmp_path / "weights" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3
    weights = {k: v for name in files for k, v in load_file(tmp_path / "weights" / name).items()}
    assert_state_equal(weights, final)
    # Offline, on one process, the shards every rank wrote become whole weights again.
    consolidate(folder, tmp_path / "consolidated", max_shard_size="100KB")
    index = json.loads((tmp_path / "consolidated" / "model.safetensors.index.json").read_text())
    weights = {k: v for name in set(index["weight_map"].values())
               for k, v in load_file(tmp_path / "consolidated" / name).items()}
    assert_state_equal(weights, torch.load(tmp_path / "at_checkpoint.pt"))


def _wait_for_a_half_written_save(job: Job, checkpoints: pathlib.Path) -> pathlib.Path:
    """Waits (with a deadline) until a committed checkpoint exists and a newer one is half written."""
    deadline = time.monotonic() + JOB_TIMEOUT / 2
    while time.monotonic() < deadline:
        if not job.running():
            job.kill_group()
            pytest.fail(f"the job ended (exit {job.returncode}) before a save was caught half-written:\n"
                        f"{job.output[-4000:]}")
        committed = list_checkpoints(checkpoints) if checkpoints.is_dir() else []
        temps = sorted(checkpoints.glob(".checkpoint_*.tmp")) if checkpoints.is_dir() else []
        for temp in temps:
            names = os.listdir(temp) if temp.exists() else []
            if committed and "random_states_0.pt" in names and MANIFEST_NAME not in names:
                return temp
        time.sleep(0.01)
    pytest.fail("no save was caught half-written before the deadline")


def test_an_async_sharded_save_killed_mid_write_leaves_the_previous_checkpoint_latest(tmp_path: pathlib.Path) -> None:
    checkpoints = tmp_path / "project" / "checkpoints"
    job = Job(torchrun(2, "sharded_worker.py", "async", "--out", str(tmp_path), "--steps", "40", "--slow", "0.5"))
    try:
        temp = _wait_for_a_half_written_save(job, checkpoints)
    finally:
        job.kill_group()
    survivors = list_checkpoints(checkpoints)
    assert survivors and all(is_intact(folder) for folder in survivors)
    assert not (checkpoints / temp.name[1:-len(".tmp")]).exists()  # the killed save never appeared
    # The next run resumes from the newest intact checkpoint and ends as an uninterrupted run does.
    run(forked(2, "sharded_worker.py", "continue", "--out", str(tmp_path), "--steps", "8", "--tag", "after")).check()
    run(forked(2, "sharded_worker.py", "reference", "--out", str(tmp_path), "--steps", "8", "--tag", "ref")).check()
    assert_state_equal(torch.load(tmp_path / "final_after.pt"), torch.load(tmp_path / "final_ref.pt"))


def test_a_damaged_shard_is_named_on_every_rank_and_the_previous_checkpoint_loads(tmp_path: pathlib.Path) -> None:
    run(forked(2, "sharded_worker.py", "async", "--out", str(tmp_path), "--steps", "2")).check()
    checkpoints = tmp_path / "project" / "checkpoints"
    newest = list_checkpoints(checkpoints)[-1]
    shard = newest / "shards" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    run(forked(2, "sharded_worker.py", "load", "--out", str(tmp_path), "--ckpt", str(newest))).check()
    for facts in _ranks(tmp_path, "load", 2):
        assert facts["explicit"].startswith("CheckpointError") and "__1_0.distcp" in facts["explicit"], facts
        assert facts["unchanged"]
        # load_state() passes over the damaged newest checkpoint (with a warning) for the one before.
        assert facts["newest"] == list_checkpoints(checkpoints)[-2].name and facts["step"] == 1


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_with_its_oserror_and_a_retry_succeeds(
        tmp_path: pathlib.Path) -> None:
    run(forked(2, "sharded_worker.py", "full-disk", "--out", str(tmp_path))).check()
    checkpoints = tmp_path / "project" / "checkpoints"
    for facts in _ranks(tmp_path, "disk", 2):
        # Rank 1's own error on both ranks, naming its shard file: not DCP's CheckpointException.
        assert facts["failed"].startswith("OSError: [Errno 27]") and facts["errno"] == 27, facts
        assert "shards/__1_0.distcp" in facts["failed"], facts
        assert facts["first"] == "checkpoint_0"
        assert facts["retry"] == "checkpoint_2", facts  # automatic naming: the retry takes the next number
    assert [folder.name for folder in list_checkpoints(checkpoints)] == ["checkpoint_0", "checkpoint_2"]
    assert all(is_intact(folder) for folder in list_checkpoints(checkpoints))
    # The failed save left nothing behind: no temporary folder, no half-written checkpoint_1.
    assert sorted(path.name for path in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_2"]
