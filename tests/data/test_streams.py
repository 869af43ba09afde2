"""Prepared streams on one process (fittrain/data/streams.py): the same batches as plain PyTorch,
the same RNG use, no length, and a pass that resumes exactly from a checkpoint."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from fittrain import Accelerator
from fittrain.checkpoint import CheckpointMismatchError
from stream_data import Numbers, ReadyBatches, StatefulNumbers, hugging_face, indices


def _flat(batches) -> list[list[int]]:
    return [indices(b) for b in batches]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make", [
    lambda w: DataLoader(Numbers(23), batch_size=4, num_workers=w),
    lambda w: DataLoader(Numbers(23), batch_size=4, num_workers=w, drop_last=True),
    lambda w: DataLoader(StatefulNumbers(23), batch_size=5, num_workers=w),
    lambda w: DataLoader(ReadyBatches(7), batch_size=None, num_workers=w),
    lambda w: DataLoader(hugging_face(23, shards=4, buffer_size=6), batch_size=4, num_workers=w),
], ids=["numbers", "drop_last", "stateful", "ready_batches", "hugging_face_shuffled"])
def test_one_process_yields_the_plain_loaders_batches_and_draws_the_same_randomness(make, workers: int) -> None:
    torch.manual_seed(3)
    plain = _flat(make(workers))
    after_plain = torch.get_rng_state()
    torch.manual_seed(3)
    prepared = Accelerator(cpu=True).prepare(make(workers))
    assert _flat(prepared) == plain
    assert torch.equal(torch.get_rng_state(), after_plain)


def test_a_stream_has_no_length_and_says_so() -> None:
    prepared = Accelerator(cpu=True).prepare(DataLoader(Numbers(8), batch_size=4))
    with pytest.raises(TypeError, match="has no length.*max_steps"):
        len(prepared)


def test_split_batches_is_refused_for_a_stream() -> None:
    with pytest.raises(ValueError, match="split_batches=True.*Numbers"):
        Accelerator(cpu=True, split_batches=True).prepare(DataLoader(Numbers(8), batch_size=4))


def test_each_pass_sets_the_datasets_epoch() -> None:
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(DataLoader(hugging_face(30, shards=2, buffer_size=10), batch_size=30))
    first, second = _flat(prepared), _flat(prepared)
    assert sorted(first[0]) == sorted(second[0]) == list(range(30))
    assert first != second  # set_epoch(1) reshuffled the second pass


def _resume_mid_pass(make, tmp_path, consumed: int) -> tuple[list[list[int]], list[list[int]], list]:
    """Saves a pass after `consumed` batches, loads it in a new Accelerator and finishes the pass."""
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(make())
    batches = iter(prepared)
    for _ in range(consumed):
        next(batches)
    acc.save_state(tmp_path / "ckpt")
    expected = _flat(batches)
    acc2 = Accelerator(cpu=True)
    again = acc2.prepare(make())
    acc2.load_state(tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rest = _flat(acc2.skip_first_batches(again, consumed))
    return expected, rest, [str(w.message) for w in caught]


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("make,warns", [
    (lambda w: DataLoader(StatefulNumbers(41), batch_size=4, num_workers=w), False),
    (lambda w: DataLoader(hugging_face(41, shards=6), batch_size=4, num_workers=w), False),
    (lambda w: DataLoader(hugging_face(41, shards=6, buffer_size=8), batch_size=4, num_workers=w), False),
    (lambda w: DataLoader(Numbers(41), batch_size=4, num_workers=w), True),
], ids=["stateful", "hugging_face", "hugging_face_shuffled", "stateless"])
def test_a_checkpoint_mid_pass_continues_with_exactly_the_next_batch(make, warns: bool, workers: int,
                                                                    tmp_path) -> None:
    for consumed in (1, 5):  # 5 passes the end of a worker's share when there are 3 workers
        expected, rest, messages = _resume_mid_pass(lambda: make(workers), tmp_path / str(consumed), consumed)
        assert rest == expected and rest
        replay = [m for m in messages if "stream without state_dict" in m]
        assert bool(replay) == warns
        if warns:
            assert f"the {consumed} batches" in replay[0]


def test_a_torchdata_stateful_dataloader_is_accepted_and_resumed(tmp_path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        return StatefulDataLoader(hugging_face(30, shards=4, buffer_size=5), batch_size=4, num_workers=2)

    expected, rest, _ = _resume_mid_pass(make, tmp_path, 3)
    assert rest == expected and rest


def test_a_pass_saved_with_other_workers_is_refused_before_anything_loads(tmp_path) -> None:
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(DataLoader(Numbers(20), batch_size=4, num_workers=2))
    batches = iter(prepared)
    next(batches)
    acc.save_state(tmp_path / "ckpt")
    acc2 = Accelerator(cpu=True)
    acc2.prepare(DataLoader(Numbers(20), batch_size=4, num_workers=3))
    with pytest.raises(CheckpointMismatchError, match="2 worker streams.*reads 3.*same num_workers"):
        acc2.load_state(tmp_path / "ckpt")
