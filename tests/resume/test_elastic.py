"""Elastic resume: a checkpoint saved by N processes continues on M, with real gloo processes.

One chain of legs per loop (Trainer, Accelerate-style loop) and strategy, each leg a fresh
torchrun job that seeds its RNGs with 999 and starts from the previous leg's checkpoint
(scripts/elastic_job.py: 22 float64 samples in batches of 2 per process, 3 epochs, SGD with
momentum, no randomness but the shuffle):

    leg  processes  from step  saves after step  what the resume meets
    A    1          0          14                -
    B    2          14         16                1 -> 2: 6 of epoch 1's samples consumed, not a whole round of 4
    C    4          16         17                2 -> 4: inside epoch 1's re-dealt pass (14 consumed; rounds of 8)
    D    2          17         19                4 -> 2: epoch 1 consumed whole but not closed (an empty pass)
    E    1          19         end (26)          2 -> 1: 8 of epoch 2's samples consumed

The chain runs with the Trainer under DDP (full checkpoints) and under FSDP2 (sharded, as FSDP2
saves by default), and with an Accelerate-style loop under FSDP2 (full checkpoints). FSDP2 shards
nothing on one process, where a full optimizer state is keyed by parameter index: the load
re-keys it by parameter name for the sharded run, and back.

Checked, sample by sample: every rank's indices at every step are those the dealing rule gives
from the epoch's order (the plain DataLoader's, the same on any number of processes), and each
epoch's samples, read in step and rank order, are its order exactly once (then the padding of the
last round, which repeats its start). And the weights at the end equal those of a one-process
simulation of the same global batches, up to floating-point reduction order (see `ATOL`).
"""

from __future__ import annotations

import io
import json
import zlib
from typing import Any

import pytest
import torch
from torch import nn

from resume_support import load_params
from support.jobs import SCRIPTS, Job, forked, load_script

pytestmark = pytest.mark.subprocess

JOB = SCRIPTS / "elastic_job.py"
#: (processes, save after this optimizer step or None: run to the end) per leg.
CHAIN = [(1, 14), (2, 16), (4, 17), (2, 19), (1, None)]
#: The weights are float64. DDP averages per-process mean gradients (gloo all-reduce) and FSDP2
#: reduce-scatters them, where the simulation takes one mean over the global batch: the same
#: numbers summed in another order, which differs by a few float64 ulps (~1e-16 relative) per
#: step. 26 SGD steps on this small, smooth model (lr 0.1, |weights| ~1) keep that growth far
#: below 1e-12; one sample dealt wrongly moves a weight by ~lr * |gradient| / batch ~ 1e-3
#: (the test checks that the uninterrupted one-process run is that far away). 1e-10 sits between.
ATOL = 1e-10


@pytest.fixture(scope="module")
def job() -> Any:
    return load_script("elastic_job")


def epoch_orders(job: Any) -> list[list[int]]:
    """Each epoch's order: the unprepared DataLoader's, from the same generator."""
    loader = job.make_loader()
    return [[int(i) for _, _, index in loader for i in index] for _ in range(job.EPOCHS)]


def expected_steps(job: Any, chain: list[tuple[int, int | None]]) -> list[tuple[int, int, list[list[int]]]]:
    """(step, epoch, each rank's indices) for every optimizer step of the chain: each leg deals the
    rest of the current epoch's order from the consumed count in rounds of batch_size * processes
    (the last round padded from the start of the epoch when there is more than one process), then
    whole epochs the same way."""
    orders, n, size = epoch_orders(job), job.SAMPLES, job.BATCH_SIZE
    steps: list[tuple[int, int, list[list[int]]]] = []
    epoch, consumed = 0, 0
    for world, save_at in chain:
        while epoch < job.EPOCHS and (save_at is None or len(steps) < save_at):
            if consumed >= n:
                epoch, consumed = epoch + 1, 0
                continue
            order, per_round = orders[epoch], size * world
            chunk = order[consumed:consumed + per_round]
            if world > 1:
                chunk += [order[i % n] for i in range(per_round - len(chunk))]
            steps.append((len(steps) + 1, epoch, [chunk[r * size:(r + 1) * size] for r in range(world)]))
            consumed = min(consumed + per_round, n)
    return steps


def simulate(job: Any, steps: list[tuple[int, int, list[list[int]]]]) -> dict[str, torch.Tensor]:
    """One process, one mean over each step's global batch (all ranks' samples, padding included)."""
    data, net = job.Indexed(), job.make_net()
    optimizer = job.make_optimizer(net.parameters())
    for _, _, ranks in steps:
        index = torch.tensor([i for batch in ranks for i in batch])
        nn.functional.mse_loss(net(data.x[index]), data.y[index]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}


def recorded_steps(out: Any, chain: list[tuple[int, int | None]]) -> list[tuple[int, int, list[list[int]]]]:
    """What the legs' ranks recorded, as (step, epoch, each rank's indices)."""
    steps: list[tuple[int, int, list[list[int]]]] = []
    for leg, (world, _) in enumerate(chain):
        ranks = [torch.load(out / f"leg{leg}_rank{r}.pt", weights_only=True) for r in range(world)]
        assert len({len(r) for r in ranks}) == 1, f"leg {leg}: ranks took different numbers of steps"
        for records in zip(*ranks):
            assert len({(step, epoch) for step, epoch, _ in records}) == 1, records
            steps.append((records[0][0], records[0][1], [list(indices) for _, _, indices in records]))
    return steps


def run_chain(tmp_path: Any, chain: list[tuple[int, int | None]], mode: str, strategy: str,
              state_dict_type: str) -> None:
    previous = None
    for leg, (world, save_at) in enumerate(chain):
        checkpoint = tmp_path / f"checkpoint_{leg}"
        args = ["--mode", mode, "--out", tmp_path, "--tag", f"leg{leg}", "--strategy", strategy,
                "--state-dict-type", state_dict_type]
        args += ["--resume", previous] if previous else []
        args += ["--save-at", save_at, "--checkpoint", checkpoint] if save_at else []
        Job(forked(world, JOB, *args)).wait()
        previous = checkpoint


@pytest.mark.parametrize("mode, strategy, state_dict_type", [
    # Each loop and each checkpoint kind once (a chain is 5 jobs): the Trainer under DDP; the
    # Accelerate-style loop under FSDP2 with full checkpoints (optimizer state re-keyed between
    # index and name at 1 <-> 2 processes); the Trainer under FSDP2 with its default, sharded.
    ("trainer", "ddp", "full"), ("loop", "fsdp", "full"), ("trainer", "fsdp", "sharded")])
def test_elastic_resumes_deal_each_sample_once_and_match_a_run_switched_at_each_checkpoint(
        tmp_path, job, mode, strategy, state_dict_type):
    chain = CHAIN
    run_chain(tmp_path, chain, mode, strategy, state_dict_type)

    want = expected_steps(job, chain)
    got = recorded_steps(tmp_path, chain)
    assert [s[:2] for s in got] == [s[:2] for s in want]
    for (step, epoch, ranks), (_, _, expected) in zip(got, want):
        assert ranks == expected, f"step {step} (epoch {epoch}): ranks trained on {ranks}, expected {expected}"
    orders = epoch_orders(job)
    for epoch, order in enumerate(orders):
        seen = [i for _, e, ranks in got if e == epoch for batch in ranks for i in batch]
        assert seen[:job.SAMPLES] == order, f"epoch {epoch}: samples {seen} are not its order {order}"
        assert seen[job.SAMPLES:] == order[:len(seen) - job.SAMPLES]  # padding repeats the epoch's start

    weights = {k.removeprefix("net."): v for k, v in load_params(tmp_path / f"leg{len(chain) - 1}.safetensors").items()}
    reference = simulate(job, want)
    assert sorted(weights) == sorted(reference)
    for key, value in reference.items():
        assert torch.allclose(weights[key], value, rtol=0, atol=ATOL), (
            f"{key} differs by {(weights[key] - value).abs().max().item():.3g}")
    # The tolerance discriminates: one process left alone (other global batches) ends far away.
    alone = simulate(job, expected_steps(job, [(1, None)]))
    assert max((alone[k] - reference[k]).abs().max().item() for k in reference) > 1e-4


# ------------------------------------------------------------------ refusals and new ranks' RNG, on one process
def _rewrite(folder: Any, name: str, data: bytes) -> None:
    """Writes `name` and makes the manifest agree (the test edits a real checkpoint on disk)."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _as_two_processes(folder: Any, edit_rank1: Any = None) -> None:
    """Makes a one-process checkpoint look saved by 2 processes: rank 1's files copy rank 0's."""
    for kind in ("random_states", "data_states"):
        _rewrite(folder, f"{kind}_1.pt", (folder / f"{kind}_0.pt").read_bytes())
    if edit_rank1 is not None:
        buffer = io.BytesIO()
        torch.save(edit_rank1(torch.load(folder / "data_states_1.pt", weights_only=True)), buffer)
        _rewrite(folder, "data_states_1.pt", buffer.getvalue())
    meta = json.loads((folder / "accelerator_state.json").read_text())
    _rewrite(folder, "accelerator_state.json", json.dumps({**meta, "num_processes": 2}).encode())


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(8.0).unsqueeze(1))


def _saved_one_process_run(folder: Any, loader: Any) -> Any:
    from fittrain import Accelerator

    acc = Accelerator(cpu=True)
    model = nn.Linear(1, 1)
    model, optimizer, dl = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    next(iter(dl))  # one batch into the epoch
    acc.save_state(folder)
    return acc


def test_a_stream_under_way_is_refused_on_another_number_of_processes(tmp_path):
    from torch.utils.data import DataLoader

    from fittrain import CheckpointError

    acc = _saved_one_process_run(tmp_path / "ckpt", DataLoader(_Stream(), batch_size=2))
    _as_two_processes(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as info:
        acc.load_state(tmp_path / "ckpt")
    message = str(info.value)
    assert type(info.value).__name__ == "CheckpointMismatchError"
    assert "saved by 2 processes, but this run has 1" in message and "data loader 0 reads a stream" in message
    assert "1 batches into epoch 0" in message and "Resume with 2 processes" in message


def test_processes_that_disagree_on_the_position_are_refused(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain import CheckpointError

    loader = DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=2, shuffle=True)
    acc = _saved_one_process_run(tmp_path / "ckpt", loader)
    _as_two_processes(tmp_path / "ckpt", lambda states: [{**states[0], "order_consumed": 4}])
    with pytest.raises(CheckpointError, match=r"data_states_1\.pt.*disagree on how far data loader 0 got"):
        acc.load_state(tmp_path / "ckpt")


def test_new_ranks_get_rng_states_derived_from_process_0_and_their_rank(tmp_path):
    """Rank 2 of a run resumed from a 2-process checkpoint: a valid state, the same every time,
    and not the state of any other rank; ranks 0 and 1 keep theirs."""
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain.checkpoint import CheckpointReader
    from fittrain.checkpoint.restore import _read_rng_states
    from fittrain.checkpoint.rng import check_rng_state

    loader = DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=2)
    _saved_one_process_run(tmp_path / "ckpt", loader)
    _as_two_processes(tmp_path / "ckpt")
    reader = CheckpointReader(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "random_states_0.pt", weights_only=True)
    two, again, three = (_read_rng_states(reader, 2, rank) for rank in (2, 2, 3))
    check_rng_state(two)
    assert torch.equal(_read_rng_states(reader, 2, 1)["torch"], saved["torch"])
    assert torch.equal(two["torch"], again["torch"]) and torch.equal(two["numpy_keys"], again["numpy_keys"])
    assert not torch.equal(two["torch"], three["torch"]) and not torch.equal(two["torch"], saved["torch"])
    assert not torch.equal(two["python_state"][:8], two["numpy_keys"][:8])  # the libraries are seeded apart
