"""Manual optimization (two optimizers, a tiny GAN) on 2 real gloo processes under DDP and FSDP2
(scripts/manual_worker.py): the replicas agree, match a 1-process run on the same global batches,
and a run resumed from a mid-training checkpoint ends bit-identical to the uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from support.jobs import forked, load_script, run
from support.results import assert_state_close, read_results

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    worker = load_script("manual_worker")
    return worker.fit(batch_size=8, project_dir=str(tmp_path_factory.mktemp("manual_reference")))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_optimizers_train_alike_on_two_processes(strategy: str, reference: dict, tmp_path) -> None:
    run(forked(2, "manual_worker.py", "--out", str(tmp_path), "--strategy", strategy)).check()
    rank0, rank1 = read_results(tmp_path, 2)
    assert (rank0["world"], rank1["world"]) == (2, 2)
    for key in rank0["weights"]:
        assert torch.equal(rank0["weights"][key], rank1["weights"][key]), f"replicas disagree on {key}"
    # The gradients were averaged over the processes: the same steps as one process on both halves.
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)
    assert rank0["global_step"] == reference["global_step"] == 4  # accumulation windows, not opt.step() calls
    assert rank0["lrs"] == reference["lrs"] == rank1["lrs"]
    # Both parts trained.
    torch.manual_seed(0)
    start = load_script("manual_worker").TinyGAN().state_dict()
    for part in ("generator", "discriminator"):
        assert any(not torch.equal(start[k], rank0["weights"][k]) for k in start if k.startswith(part)), part
    resumed = rank0["resumed"]
    assert resumed["global_step"] == 4 and resumed["lrs"] == rank0["lrs"]
    for key in rank0["weights"]:
        assert torch.equal(resumed["weights"][key], rank0["weights"][key]), f"the resumed run differs on {key}"


def test_toggle_optimizer_under_ddp_matches_one_process(tmp_path) -> None:
    """Lightning's GAN idiom, `toggle_optimizer(opt_g)` around the generator's step, on 2 DDP ranks: the
    discriminator's parameters get no gradient from the generator's backward (with accumulation,
    they would otherwise add into its next step), DDP's reducer copes with the frozen parameters,
    and the ranks match a 1-process run of the same global batches and resume exactly."""
    worker = load_script("manual_worker")
    reference = worker.fit(batch_size=8, project_dir=str(tmp_path / "reference"), toggle=True)
    untoggled = worker.fit(batch_size=8, project_dir=str(tmp_path / "untoggled"))
    assert any(not torch.equal(reference["weights"][k], untoggled["weights"][k]) for k in reference["weights"]), \
        "toggling changed nothing: the test would not see a toggle that does nothing"
    run(forked(2, "manual_worker.py", "--out", str(tmp_path / "ranks"), "--strategy", "ddp", "--toggle")).check()
    rank0, rank1 = read_results(tmp_path / "ranks", 2)
    for key in rank0["weights"]:
        assert torch.equal(rank0["weights"][key], rank1["weights"][key]), f"replicas disagree on {key}"
        assert torch.equal(rank0["resumed"]["weights"][key], rank0["weights"][key]), f"the resume differs on {key}"
    assert_state_close(rank0["weights"], reference["weights"], atol=1e-6)
