"""Trainer.fit on 2 real gloo processes matches a 1-process run with twice the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fittrain.checkpoint.run_folders import run_folder
from support.jobs import forked, load_script, run
from support.results import assert_state_close, read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = shared_folder(tmp_path_factory, "trainer",
                        lambda out: run(forked(2, "trainer_worker.py", "--out", str(out))).check())
    return {"ranks": read_results(out, 2), "out": out}


def test_two_process_trainer_matches_one_process_with_double_batch(trainer_job, tmp_path):
    worker = load_script("trainer_worker")
    reference = worker.fit(batch_size=8, project_dir=str(tmp_path))
    rank0, rank1 = trainer_job["ranks"]
    assert (rank0["world"], rank1["world"]) == (2, 2)
    for key in rank0["weights"]:
        assert torch.equal(rank0["weights"][key], rank1["weights"][key]), f"replicas disagree on {key}"
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)
    assert rank0["global_step"] == rank1["global_step"] == reference["global_step"] == 8


def test_validation_metrics_average_over_every_sample_on_every_rank(trainer_job):
    worker = load_script("trainer_worker")
    rank0, rank1 = trainer_job["ranks"]
    assert rank0["metrics"]["val_loss"] == rank1["metrics"]["val_loss"]
    model = worker.Net()
    model.load_state_dict(rank0["weights"])
    x, y = worker.data(10, 2).tensors
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x), y).item()
    assert rank0["metrics"]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_list_of_batches_is_shared_out_across_ranks(trainer_job, tmp_path):
    # Rank r takes batches r, r+2, ...: averaged over 2 ranks, that is one process stepping on
    # each pair of batches concatenated. Validation batches (3 of them) are split unevenly.
    worker = load_script("trainer_worker")
    reference = worker.fit_batches(merge=2, project_dir=str(tmp_path))
    rank0, rank1 = (r["batches"] for r in trainer_job["ranks"])
    for key in rank0["weights"]:
        assert torch.equal(rank0["weights"][key], rank1["weights"][key]), f"replicas disagree on {key}"
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)
    assert rank0["global_step"] == reference["global_step"] == 8
    assert rank0["metrics"]["val_loss"] == rank1["metrics"]["val_loss"]
    assert rank0["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-5)


def test_checkpoint_has_one_rng_file_per_rank_and_weights_once(trainer_job):
    folder = run_folder(trainer_job["out"]) / "checkpoint_0"  # the run's save after fit
    names = sorted(p.name for p in folder.iterdir())
    assert "random_states_0.pt" in names and "random_states_1.pt" in names
    assert names.count("model.safetensors") == 1 and "manifest.json" in names
