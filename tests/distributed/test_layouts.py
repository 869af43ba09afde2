"""Every layout of a device mesh on 4 real gloo processes, with a small GPT (scripts/gpt.py): DDP,
FSDP2, HSDP, tensor parallelism (TP), FSDP2+TP and replication+TP train as one process does, resume
bitwise from their own checkpoints, and load each other's. The job: scripts/layouts_worker.py (the
`layouts_job` fixture, conftest.py). Bad plans and layouts are checked on one process."""

from __future__ import annotations

import pathlib
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

from fittrain import Accelerator, ParallelismConfig
from fittrain.checkpoint import load_model_weights
from fittrain.checkpoint.consolidate import consolidate
from fittrain.distributed.memory_estimate import estimate_memory
from fittrain.distributed.strategies.tp_plan import plan_of, resolve_plan
from support.jobs import load_script
from support.results import assert_state_equal

LAYOUTS = tuple(load_script("gpt").LAYOUTS)  # DDP, FSDP2, HSDP, TP, FSDP2+TP, replication+TP
#: Every layout sums each gradient in another order than one process (reduce-scatters, all-reduces
#: of partial sums): the step losses agree to float32 rounding of the sums...
LOSS_ATOL = 1e-5
#: ...and the weights after 8 AdamW steps further apart, because Adam divides by the root of a
#: small second moment, which magnifies a rounding difference in a tiny gradient.
WEIGHT_ATOL = 3e-3


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    return load_script("gpt")


@pytest.fixture(scope="module")
def one_process(gpt: ModuleType) -> dict[str, Any]:
    """Two epochs on this process with the whole global batch: what every layout must reproduce."""
    acc = Accelerator()
    model, optimizer, loader = gpt.prepared(acc)
    norms: list[float] = []
    first = gpt.train_epoch(acc, model, optimizer, loader, norms=norms)
    after_first = gpt.full_state(acc, model)
    losses = first + gpt.train_epoch(acc, model, optimizer, loader)
    return {"losses": losses, "norms": norms, "after_first": after_first, "state": gpt.full_state(acc, model)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_trains_as_one_process_does(layouts_job: dict[str, Any], one_process: dict[str, Any],
                                                gpt: ModuleType, layout: str) -> None:
    run = layouts_job["ranks"][0]["layouts"][layout]
    torch.testing.assert_close(run["losses"], one_process["losses"], atol=LOSS_ATOL, rtol=0)
    # clip_grad_norm_ returns the total norm over every DTensor mesh, not a rank's part of it (a plain
    # torch clip on TP's mixed meshes raises; a partial norm would be about half the true one here).
    torch.testing.assert_close(run["norms"], one_process["norms"], atol=LOSS_ATOL, rtol=0)
    assert min(one_process["norms"]) > gpt.MAX_NORM  # every step clipped, so clipping mattered
    _close(run["after"], one_process["state"], WEIGHT_ATOL)


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_resumes_bitwise_from_its_own_checkpoint(layouts_job: dict[str, Any], layout: str) -> None:
    run = layouts_job["ranks"][0]["layouts"][layout]
    assert run["again"] == run["losses"][len(run["again"]):]
    assert_state_equal(run["again_state"], run["after"])
    shards = layouts_job["out"] / f"{layout}_checkpoint" / "shards"
    assert (shards / "metadata.json").is_file() == (layout != "ddp")  # sharded by default when sharding


@pytest.mark.subprocess
def test_data_follows_the_data_parallel_ranks_only(layouts_job: dict[str, Any], gpt: ModuleType) -> None:
    ranks = [rank["layouts"] for rank in layouts_job["ranks"]]
    groups = {"ddp": [0, 1, 2, 3], "fsdp": [0, 1, 2, 3], "hsdp": [0, 1, 2, 3], "tp": [0, 0, 0, 0],
              "fsdp_tp": [0, 0, 1, 1], "replicate_tp": [0, 0, 1, 1]}  # each rank's data-parallel rank
    for layout, dp_ranks in groups.items():
        batches = [ranks[r][layout]["first_batch"] for r in range(4)]
        for r in range(4):  # same data-parallel rank, same batch; another, another batch
            assert all((batches[r] == batches[o]) == (dp_ranks[r] == dp_ranks[o]) for o in range(4)), layout
        assert len(batches[0]) == gpt.GLOBAL_BATCH // (max(dp_ranks) + 1)
        assert [ranks[r][layout]["ranks"][0] for r in range(4)] == dp_ranks  # Accelerator.data_parallel_rank
        # gather_for_metrics gives each sample of the epoch once, not once per tp rank.
        assert sorted(ranks[0][layout]["seen"]) == list(range(gpt.SAMPLES)), layout
    streams = [rank["stream"] for rank in layouts_job["ranks"]]  # an IterableDataset follows the same rule
    assert streams[0]["first_batch"] == streams[1]["first_batch"] != streams[2]["first_batch"]
    assert streams[2]["first_batch"] == streams[3]["first_batch"]
    assert sorted(streams[0]["seen"]) == list(range(gpt.SAMPLES))


@pytest.mark.subprocess
def test_the_mesh_and_each_ranks_place_in_it(layouts_job: dict[str, Any]) -> None:
    names = ("dp_replicate", "dp_shard", "tp")
    meshes = {"ddp": None, "fsdp": ((4,), ("dp_shard",)), "hsdp": ((2, 2), ("dp_replicate", "dp_shard")),
              "tp": ((1, 1, 4), names), "fsdp_tp": ((1, 2, 2), names), "replicate_tp": ((2, 1, 2), names)}
    # (data-parallel rank, rank within the shard group, tensor-parallel rank) of ranks 0..3
    places = {"ddp": [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)],
              "fsdp": [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0)],
              "hsdp": [(0, 0, 0), (1, 1, 0), (2, 0, 0), (3, 1, 0)],
              "tp": [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)],
              "fsdp_tp": [(0, 0, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)],
              "replicate_tp": [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]}
    for layout in LAYOUTS:
        assert layouts_job["ranks"][0]["layouts"][layout]["mesh"] == meshes[layout], layout
        assert layouts_job["ranks"][0]["layouts"][layout]["is_fsdp2"] == (layout in ("fsdp", "hsdp", "fsdp_tp"))
        assert [rank["layouts"][layout]["ranks"] for rank in layouts_job["ranks"]] == places[layout], layout


@pytest.mark.subprocess
def test_a_fsdp_tp_checkpoint_loads_under_every_layout_and_offline(layouts_job: dict[str, Any], gpt: ModuleType,
                                                                   one_process: dict[str, Any],
                                                                   tmp_path: pathlib.Path) -> None:
    saved = layouts_job["ranks"][0]["layouts"]["fsdp_tp"]["saved"]
    _close(saved, one_process["after_first"], WEIGHT_ATOL)  # the reference: what one process holds there
    for layout in LAYOUTS:  # every rank reads the parts it needs of the (dp_shard 2, tp 2) shards
        assert_state_equal(layouts_job["ranks"][0]["cross"][layout], saved)
    folder = layouts_job["out"] / "fsdp_tp_checkpoint"
    acc = Accelerator()  # one process: the whole model and optimizer from the shards
    model, optimizer, _ = gpt.prepared(acc, seed=5)
    acc.load_state(folder)
    assert_state_equal(model.state_dict(), saved)
    assert len(optimizer.state) == len(list(model.parameters()))
    consolidate(folder, tmp_path / "consolidated")
    assert_state_equal(load_file(tmp_path / "consolidated" / "model.safetensors"), saved)
    assert_state_equal(load_model_weights(folder), saved)


@pytest.mark.subprocess
def test_full_checkpoints_and_save_model_under_tp(layouts_job: dict[str, Any]) -> None:
    full = layouts_job["ranks"][0]["full"]
    assert "model.safetensors" in full["files"] and "shards" not in full["files"]
    assert_state_equal(full["loaded"], full["saved"])
    assert_state_equal(load_model_weights(layouts_job["out"] / "tp_model"), full["saved"])  # save_model


@pytest.mark.subprocess
def test_a_2x2_run_resumed_as_4x1_sees_every_sample_of_the_epoch_once(layouts_job: dict[str, Any],
                                                                      gpt: ModuleType) -> None:
    elastic = layouts_job["ranks"][0]["elastic"]
    assert len(elastic["before"]) == 3 * gpt.GLOBAL_BATCH
    assert sorted(elastic["before"] + elastic["after"]) == list(range(gpt.SAMPLES))


@pytest.mark.subprocess
def test_accumulation_compile_a_presplit_model_bf16_and_the_trainer_work(layouts_job: dict[str, Any], gpt: ModuleType,
                                                                   one_process: dict[str, Any]) -> None:
    rank0 = layouts_job["ranks"][0]
    for scenario in ("compiled", "split_by_hand"):
        losses = rank0[scenario]["losses"]
        torch.testing.assert_close(losses, one_process["losses"][:len(losses)], atol=LOSS_ATOL, rtol=0)
    # Two micro-batches of 2 per data-parallel rank make the same global batch of 8: the same steps.
    assert rank0["accumulate"]["steps"] == 2 * gpt.SAMPLES // gpt.GLOBAL_BATCH
    _close(rank0["accumulate"]["state"], one_process["after_first"], WEIGHT_ATOL)
    losses = rank0["bf16"]["losses"]
    assert all(loss == loss and abs(loss - ref) < 0.05 for loss, ref in zip(losses, one_process["losses"]))
    for rank in layouts_job["ranks"]:
        trainer = rank["trainer"]
        assert trainer["steps"] == trainer["resumed_steps"] == 2 * gpt.SAMPLES // gpt.GLOBAL_BATCH
        assert trainer["loss"] == trainer["loss"]  # finite
        assert trainer["strategy"] == "TensorParallelStrategy(dp_replicate=1, dp_shard=2, tp=2)"
    # Trainer(resume_from=...) from the checkpoint after step 3 of 8 ends bitwise where the whole fit did.
    assert_state_equal(rank0["trainer"]["resumed"], rank0["trainer"]["weights"])


#: How far a forward's measured allocations may be from `estimate_memory`'s activations. Data-parallel
#: layouts run the plain model, whose saved tensors the estimate counts: within 5% measured. Under TP
#: the estimate runs a copy narrowed to one rank's split layers; DTensor's dispatch keeps a few more
#: intermediates than that copy, and gloo's threads allocate receive buffers while the profile runs,
#: which varies from run to run (measured over 12 runs: the estimate is 78-98% of what a rank allocates).
ACTIVATION_TOLERANCE = {"ddp": 0.10, "fsdp": 0.10, "hsdp": 0.10, "tp": 0.30, "fsdp_tp": 0.30, "replicate_tp": 0.30}


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_estimate_matches_what_each_rank_holds(layouts_job: dict[str, Any], gpt: ModuleType, layout: str) -> None:
    held = layouts_job["ranks"][0]["memory"][layout]  # rank 0 holds the largest (padded) shards
    with torch.device("meta"):
        model = gpt.GPT()
    sample = torch.zeros(held["batch"], dtype=torch.long, device="meta")
    estimate = estimate_memory(model, ParallelismConfig(**gpt.LAYOUTS[layout]), "adamw", sample)
    for part in ("parameters", "gradients", "optimizer_state"):  # the Done-when bound: 10%
        assert abs(getattr(estimate, part) - held[part]) <= 0.10 * held[part], (part, estimate, held)
    bound = ACTIVATION_TOLERANCE[layout]
    assert abs(estimate.activations - held["activations"]) <= bound * held["activations"], (estimate, held)


# ----------------------------------------------------------------- plans and bad input (one process)
class _Attention(nn.Module):
    tp_plan = {"q": "colwise", "o": RowwiseParallel()}

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(4, 4), nn.Linear(4, 4)


def test_a_plan_is_the_models_and_its_submodules_under_their_names() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([_Attention(), _Attention()])
    model.tp_plan = {"layers.*.q": "colwise_rep"}  # the outer plan; the inner ones count too
    assert sorted(plan_of(model)) == ["layers.*.q", "layers.0.o", "layers.0.q", "layers.1.o", "layers.1.q"]
    styles = resolve_plan(model)
    assert sorted(styles) == ["layers.0.o", "layers.0.q", "layers.1.o", "layers.1.q"]
    assert type(styles["layers.1.o"]).__name__ == "RowwiseParallel"


@pytest.mark.parametrize("plan, message", [
    (None, r"has none\. Received: a model without a tp_plan attribute\. Give it one"),
    (["q"], r"tp_plan must be a dict of module names to styles.*Received: \['q'\] \(list\)"),
    ({"q": "diagonal"}, r"tp_plan\['q'\] must be one of \['colwise', 'colwise_rep', .*Received: 'diagonal'"),
    ({"layer.*.q": "colwise"}, r"pattern 'layer\.\*\.q' names no module of Sequential\. The nearest module name is "
                               r"'layers\.0\.q'"),
])
def test_a_bad_plan_is_named(plan: Any, message: str) -> None:
    model = nn.Sequential()
    model.layers = nn.ModuleList([nn.Sequential()])
    model.layers[0].q = nn.Linear(2, 2)
    if plan is not None:
        model.tp_plan = plan
    with pytest.raises(ValueError, match=message):
        resolve_plan(model)


def test_a_layer_that_does_not_split_evenly_is_named() -> None:
    model = nn.Module()
    model.q, model.o = nn.Linear(6, 6, bias=False), nn.Linear(6, 4)
    model.tp_plan = {"q": "colwise", "o": "rowwise"}
    assert sorted(resolve_plan(model, tp_size=3)) == ["o", "q"]  # 6 rows, 6 columns: 3 parts each
    with pytest.raises(ValueError, match=r"tp_plan\['q'\] splits q\.weight \(Linear, 6 along dimension 0\) between "
                                         r"tp_size=4 ranks, and 6 does not divide by 4.*Use a tp_size that divides 6"):
        resolve_plan(model, tp_size=4)


def test_a_layout_the_run_cannot_take_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"sizes multiply to 4 processes, but this run has 1\. Received: "
                                         r"dp_replicate_size=1, dp_shard_size=2, tp_size=2, cp_size=1"):
        Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))

    class AsyncTP:
        enable_async_tp = True

    with pytest.raises(ValueError, match=r"async tensor parallelism .*Received: .*tp_size=2.*enable_async_tp=True"):
        Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_handler=AsyncTP()))
    accelerate = pytest.importorskip("accelerate")  # in [dev]: the benchmarks compare with it
    with pytest.raises(ValueError, match=r"sp_size=2\): sequence parallelism is DeepSpeed's Ulysses"):
        Accelerator(parallelism_config=accelerate.ParallelismConfig(sp_size=2))
