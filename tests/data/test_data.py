"""The prepared DataLoader (fittrain/data/): placement, the user's shuffle, skipping, sharding.

Expectations come from plain PyTorch (a `DataLoader` over the same dataset) or from the sharding
rule written out by hand for tiny datasets, never from the code under test. Sharding is tested
on one process by building `DataLoaderShard` for each rank directly: the rank arithmetic is the
same as in a real group, and no process group is needed.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fittrain import Accelerator
from fittrain.data import DataLoaderShard, SkippedDataLoader, send_to_device
from fittrain.distributed.gradient_state import GradientState

META = torch.device("meta")


class IndexDataset(Dataset):
    """Sample i is tensor(i); records every __getitem__ so tests can see what was loaded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded.append(int(index))
        return torch.tensor(index)


class NoisyDataset(Dataset):
    """Each sample draws from torch's global RNG, like random augmentation does."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(3) + index


def batches(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def shard(loader: DataLoader, rank: int, world: int = 2, **kwargs: Any) -> DataLoaderShard:
    return DataLoaderShard(loader, None, GradientState(), num_processes=world, process_index=rank, **kwargs)


def prepared(n: int = 20, batch_size: int = 4, seed: int = 0, **kwargs: Any) -> DataLoaderShard:
    """A shuffled single-process loader, with the global RNG (which its passes draw their order
    from, as plain PyTorch does) seeded with `seed`."""
    torch.manual_seed(seed)
    return DataLoaderShard(DataLoader(IndexDataset(n), batch_size=batch_size, shuffle=True, **kwargs),
                           None, GradientState())


def flat(bs: list[list[int]]) -> list[int]:
    return [i for b in bs for i in b]


# ------------------------------------------------------------------ device placement
Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Record:
    inputs: torch.Tensor
    name: str
    extra: dict


def nested_batch(samples: list[torch.Tensor]) -> dict:
    t = torch.stack(samples)
    return {"tensor": t, "list": [t, 1], "tuple": (t, "keep"), "pair": Pair(t, t * 2),
            "record": Record(t, "name", {"deep": [t]}), "number": 3}


def check_on_meta(batch: dict, batch_size: int) -> None:
    assert type(batch) is dict
    assert batch["tensor"].device == META and batch["tensor"].shape == (batch_size,)
    assert type(batch["list"]) is list and batch["list"][0].device == META and batch["list"][1] == 1
    assert type(batch["tuple"]) is tuple and batch["tuple"][0].device == META and batch["tuple"][1] == "keep"
    assert type(batch["pair"]) is Pair and all(t.device == META for t in batch["pair"])
    record = batch["record"]
    assert type(record) is Record and record.inputs.device == META and record.name == "name"
    assert record.extra["deep"][0].device == META
    assert batch["number"] == 3


def test_send_to_device_walks_dict_list_tuple_namedtuple_and_dataclass():
    # The meta device makes every move visible: a tensor that was not moved stays on cpu.
    batch = nested_batch([torch.tensor(1.0), torch.tensor(2.0)])
    check_on_meta(send_to_device(batch, META), 2)
    # The input is not modified in place.
    assert batch["tensor"].device.type == "cpu" and batch["record"].inputs.device.type == "cpu"


def test_prepared_loader_places_every_nested_tensor_on_its_device():
    loader = DataLoader(IndexDataset(6), batch_size=2, collate_fn=nested_batch)
    placed = list(DataLoaderShard(loader, META, GradientState()))
    assert len(placed) == 3
    for batch in placed:
        check_on_meta(batch, 2)


def test_cpu_batches_are_handed_over_untouched():
    made = []

    def collate(samples):
        made.append(nested_batch(samples))
        return made[-1]

    got = list(DataLoaderShard(DataLoader(IndexDataset(4), batch_size=2, collate_fn=collate),
                               torch.device("cpu"), GradientState()))
    assert len(got) == 2 and all(g is m for g, m in zip(got, made))


# ------------------------------------------------------------------ the user's shuffle
def test_single_process_batches_equal_plain_pytorch_including_the_short_last_batch():
    # One process has no peer to keep in step with: 10 samples in batches of 4 end with [8, 9].
    dataset = IndexDataset(10)
    want = batches(DataLoader(dataset, batch_size=4))
    dl = Accelerator(cpu=True).prepare(DataLoader(dataset, batch_size=4))
    assert len(dl) == len(want) == 3
    assert batches(dl) == want == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for drop_last in (True, False):
        want = batches(DataLoader(dataset, batch_size=4, drop_last=drop_last))
        dl = Accelerator(cpu=True).prepare(DataLoader(dataset, batch_size=4, drop_last=drop_last))
        assert batches(dl) == want and len(dl) == len(want)


def test_shuffle_is_fixed_by_the_global_seed_and_covers_every_sample():
    first, again, other = prepared(seed=1), prepared(seed=1), prepared(seed=2)
    torch.manual_seed(1)
    epochs = [batches(first) for _ in range(3)]
    torch.manual_seed(1)
    assert [batches(again) for _ in range(3)] == epochs
    torch.manual_seed(2)
    assert batches(other) != epochs[0]
    for epoch in epochs:
        assert sorted(flat(epoch)) == list(range(20))  # every sample exactly once per epoch
        assert all(len(b) == 4 for b in epoch)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # a fresh order every epoch
    assert flat(epochs[0]) != list(range(20))  # and it is shuffled at all


def test_a_generator_on_the_loader_fixes_the_order_regardless_of_the_global_seed():
    def run(global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)
        loader = DataLoader(IndexDataset(16), batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(7))
        return batches(DataLoaderShard(loader, None, GradientState()))

    assert run(0) == run(1)


class EpochSampler(Sampler):
    """A sampler that orders by its epoch, like DistributedSampler: set_epoch picks the order."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def test_set_epoch_numbers_the_epoch_and_reaches_a_sampler_that_orders_by_it():
    def loader() -> DataLoaderShard:
        return DataLoaderShard(DataLoader(IndexDataset(12), batch_size=4, sampler=EpochSampler(12)), None,
                               GradientState())

    plain = DataLoader(IndexDataset(12), batch_size=4, sampler=EpochSampler(12))
    orders = []
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)
        orders.append(batches(plain))
    assert orders[0] != orders[1] != orders[2]
    jumped = loader()
    jumped.set_epoch(2)
    assert jumped.position.epoch == 2 and batches(jumped) == orders[2]
    # DDP-style scripts call loader.sampler.set_epoch(e); it reaches the same place.
    via_sampler = loader()
    via_sampler.sampler.set_epoch(1)
    assert batches(via_sampler) == orders[1]
    numbered = loader()
    seen = []
    for epoch in range(3):
        numbered.set_epoch(epoch)
        seen.append(batches(numbered))
    assert seen == orders


# ------------------------------------------------------------------ skipping and resuming
def test_skip_first_batches_yields_the_rest_of_the_epoch_without_loading_the_skipped():
    reference = prepared(seed=5)
    epoch0, epoch1 = batches(reference), batches(reference)

    dl = prepared(seed=5)
    skipped = Accelerator(cpu=True).skip_first_batches(dl, 3)
    assert len(skipped) == len(epoch0) - 3
    dl.dataset.loaded.clear()
    assert batches(skipped) == epoch0[3:]
    # Only the remaining batches' samples were ever loaded.
    assert sorted(dl.dataset.loaded) == sorted(flat(epoch0[3:]))
    # After that pass the loader continues with the next epoch's order.
    assert batches(dl) == epoch1


def test_skipping_a_whole_epoch_or_more_yields_nothing_and_moves_on():
    reference = prepared(seed=5)
    epoch0, epoch1 = batches(reference), batches(reference)
    dl = prepared(seed=5)
    dl.dataset.loaded.clear()
    assert batches(SkippedDataLoader(dl, len(epoch0))) == []
    assert dl.dataset.loaded == []
    assert batches(dl) == epoch1


def test_skip_first_batches_needs_a_prepared_loader():
    with pytest.raises(TypeError, match="prepare"):
        Accelerator(cpu=True).skip_first_batches(DataLoader(IndexDataset(4), batch_size=2), 1)


def test_state_dict_lets_a_fresh_loader_continue_mid_epoch():
    reference = prepared(seed=6)
    epoch0, epoch1 = batches(reference), batches(reference)

    original = prepared(seed=6)
    seen = []
    for batch in original:
        seen.append(batch.tolist())
        if len(seen) == 2:
            break
    state, rng = original.state_dict(), torch.get_rng_state()  # what a checkpoint saves
    assert state["batches_consumed"] == 2 and state["epoch"] == 0

    fresh = prepared(seed=99)  # a different seed: only the loaded state may decide the order
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)  # load_state restores the RNG too
    fresh.dataset.loaded.clear()
    # load_state_dict never skips by itself; the caller skips what the state says was consumed.
    resumed = batches(Accelerator(cpu=True).skip_first_batches(fresh, state["batches_consumed"]))
    assert seen + resumed == epoch0
    assert sorted(fresh.dataset.loaded) == sorted(flat(epoch0[2:]))
    assert batches(fresh) == epoch1


def test_state_dict_after_whole_epochs_rebuilds_the_next_order():
    reference = prepared(seed=8)
    orders = [batches(reference) for _ in range(3)]
    original = prepared(seed=8)
    batches(original), batches(original)
    state, rng = original.state_dict(), torch.get_rng_state()
    fresh = prepared(seed=0)
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)
    assert batches(fresh) == orders[2]


# ------------------------------------------------------------------ workers
def test_workers_give_the_same_batches_as_the_main_process():
    def run(num_workers: int) -> list[list[list[int]]]:
        torch.manual_seed(11)
        dl = DataLoaderShard(DataLoader(IndexDataset(12), batch_size=3, shuffle=True, num_workers=num_workers),
                             None, GradientState())
        return [batches(dl) for _ in range(2)]

    assert run(2) == run(0)


def test_random_samples_in_workers_are_reproducible_and_independent_of_skipping():
    def loader(num_workers: int = 2) -> DataLoaderShard:
        torch.manual_seed(12)
        return DataLoaderShard(DataLoader(NoisyDataset(), batch_size=3, shuffle=True, num_workers=num_workers),
                               None, GradientState())

    full = list(loader())
    assert len(full) == 4
    # Another run, another worker count: the same random values, batch for batch.
    for again in (list(loader()), list(loader(num_workers=1))):
        assert all(torch.equal(a, b) for a, b in zip(full, again))
    # The random part is really random (not the same noise for every sample).
    assert not torch.equal(full[0][0] - full[0][0].floor(), full[0][1] - full[0][1].floor())
    # Skipping k batches then reading batch k gives the full run's batch k, not a shifted stream.
    k = 2
    resumed = list(SkippedDataLoader(loader(), k))
    assert len(resumed) == len(full) - k
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[k:]))


# ------------------------------------------------------------------ sharding across processes
def test_each_rank_takes_whole_batches_in_turn():
    dataset = IndexDataset(16)
    plain = batches(DataLoader(dataset, batch_size=2))  # 8 batches
    for rank in (0, 1):
        dl = shard(DataLoader(dataset, batch_size=2), rank)
        assert batches(dl) == plain[rank::2]
        assert len(dl) == 4


def test_ranks_share_one_shuffle_and_together_cover_the_epoch_once():
    def rank_batches(rank: int) -> list[list[list[int]]]:
        torch.manual_seed(13)  # each rank seeds the same before prepare, as scripts do
        dl = shard(DataLoader(IndexDataset(16), batch_size=2, shuffle=True), rank)
        return [batches(dl) for _ in range(2)]

    r0, r1 = rank_batches(0), rank_batches(1)
    for epoch in range(2):
        assert sorted(flat(r0[epoch]) + flat(r1[epoch])) == list(range(16))
    assert r0[0] != r0[1]


def test_even_batches_pads_the_last_round_from_the_start_of_the_epoch():
    # 11 samples, batches of 2, 2 ranks: rounds [0..3] [4..7] [8, 9, 10 | 0]; Accelerate's rule.
    loader = DataLoader(IndexDataset(11), batch_size=2)
    assert batches(shard(loader, 0)) == [[0, 1], [4, 5], [8, 9]]
    assert batches(shard(loader, 1)) == [[2, 3], [6, 7], [10, 0]]
    # 10 samples in batches of 4: the second round is [8, 9] completed by 0..5.
    loader = DataLoader(IndexDataset(10), batch_size=4)
    assert batches(shard(loader, 0)) == [[0, 1, 2, 3], [8, 9, 0, 1]]
    assert batches(shard(loader, 1)) == [[4, 5, 6, 7], [2, 3, 4, 5]]


def test_a_dataset_smaller_than_one_round_wraps_around_repeatedly():
    loader = DataLoader(IndexDataset(3), batch_size=4)
    assert batches(shard(loader, 0)) == [[0, 1, 2, 0]]
    assert batches(shard(loader, 1)) == [[1, 2, 0, 1]]


def test_even_batches_false_leaves_uneven_tails():
    loader = DataLoader(IndexDataset(11), batch_size=2)
    assert batches(shard(loader, 0, even_batches=False)) == [[0, 1], [4, 5], [8, 9]]
    assert batches(shard(loader, 1, even_batches=False)) == [[2, 3], [6, 7], [10]]
    loader = DataLoader(IndexDataset(10), batch_size=2)
    assert batches(shard(loader, 0, even_batches=False)) == [[0, 1], [4, 5], [8, 9]]
    assert batches(shard(loader, 1, even_batches=False)) == [[2, 3], [6, 7]]


def test_split_batches_gives_each_rank_its_slice_of_every_batch():
    dataset = IndexDataset(16)
    plain = batches(DataLoader(dataset, batch_size=4))
    for rank in (0, 1):
        dl = shard(DataLoader(dataset, batch_size=4), rank, split_batches=True)
        assert dl.batch_size == 2 and dl.total_batch_size == 4
        assert batches(dl) == [b[2 * rank:2 * rank + 2] for b in plain]


def test_split_batches_pads_a_short_last_batch_from_the_start():
    loader = DataLoader(IndexDataset(10), batch_size=4)
    assert batches(shard(loader, 0, split_batches=True)) == [[0, 1], [4, 5], [8, 9]]
    assert batches(shard(loader, 1, split_batches=True)) == [[2, 3], [6, 7], [0, 1]]


def test_split_batches_needs_a_batch_size_divisible_by_the_processes():
    with pytest.raises(ValueError, match="batch_size=3"):
        shard(DataLoader(IndexDataset(10), batch_size=3), 0, split_batches=True)


def test_drop_last_drops_the_incomplete_round():
    loader = DataLoader(IndexDataset(11), batch_size=2, drop_last=True)
    r0, r1 = batches(shard(loader, 0)), batches(shard(loader, 1))
    assert r0 == [[0, 1], [4, 5]] and r1 == [[2, 3], [6, 7]]


@pytest.mark.parametrize("n", [1, 3, 8, 10, 11, 17])
@pytest.mark.parametrize("even_batches", [True, False])
@pytest.mark.parametrize("split_batches", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_len_matches_the_number_of_batches_yielded(n, even_batches, split_batches, drop_last):
    options = dict(even_batches=even_batches, split_batches=split_batches)
    batch_size = 6 if split_batches else 2  # divisible by every world size below
    for world in (1, 2, 3):
        per_rank = []
        for rank in range(world):
            dl = shard(DataLoader(IndexDataset(n), batch_size=batch_size, drop_last=drop_last), rank, world,
                       **options)
            per_rank.append(batches(dl))
            assert len(dl) == len(per_rank[-1]), (world, rank)
        if even_batches:
            # Every rank takes the same number of steps, or collectives would hang.
            assert len({len(b) for b in per_rank}) == 1
        if not drop_last and not even_batches:
            # No padding and no dropping: the ranks together see every sample exactly once.
            assert sorted(flat([b for bs in per_rank for b in bs])) == list(range(n))
        if drop_last:
            assert all(len(b) == batch_size // (world if split_batches else 1) for bs in per_rank for b in bs)


def test_end_of_dataloader_is_set_only_on_the_last_batch():
    state = GradientState()
    dl = DataLoaderShard(DataLoader(IndexDataset(10), batch_size=4), None, state)
    flags = [state.end_of_dataloader for _ in dl]
    assert flags == [False, False, True]
    assert state.end_of_dataloader is False  # after the loop, no batch is "the last" any more


def test_an_inner_pass_leaves_the_outer_loaders_end_flag_as_it_was():
    state = GradientState()
    outer = DataLoaderShard(DataLoader(IndexDataset(6), batch_size=4), None, state)
    inner = DataLoaderShard(DataLoader(IndexDataset(5), batch_size=4), None, state)
    seen = []
    for _ in outer:
        inner_flags = [state.end_of_dataloader for _ in inner]
        seen.append(state.end_of_dataloader)
        assert inner_flags == [False, True] and state.in_dataloader
        for _ in inner:
            break  # an inner pass left early ends too
    assert seen == [False, True] and not state.in_dataloader and not state.end_of_dataloader
