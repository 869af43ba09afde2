"""Re-dealing an epoch on another number of processes (fittrain/data: position, dealing, map_style,
batches, streams): the loader side of an elastic resume, checked on one process by building a
shard per rank, as tests/data/test_data_order.py does (tests/resume/test_elastic.py runs real ranks).

A run on N "ranks" takes some batches; a run on M ranks loads process 0's state and finishes the
epoch, then runs the next one. Expectations come from plain PyTorch (the unprepared DataLoader
gives each epoch's order) and from the dealing rule written out here: rounds of
batch_size * M samples (or M whole batches) from the consumed count on, the last round padded
from the start of the epoch.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fittrain.data import BatchesShard, DataLoaderShard, SkippedDataLoader, StreamShard
from fittrain.distributed.gradient_state import GradientState


class Samples(Dataset):
    """Sample i is tensor(i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class Buckets(Sampler):
    """A batch sampler over a shuffled order (its own generator) in batches of 3, 1, 2, 3, ..."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.generator = n, torch.Generator().manual_seed(seed)

    def _cuts(self) -> list[tuple[int, int]]:
        cuts, start, k = [], 0, 0
        while start < self.n:
            cuts.append((start, [3, 1, 2][k % 3]))
            start, k = start + cuts[-1][1], k + 1
        return cuts

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist()
        return iter([order[s:s + size] for s, size in self._cuts()])

    def __len__(self) -> int:
        return len(self._cuts())


def samples_loader(seed: int, n: int = 23, batch_size: int = 2, **kwargs: Any) -> DataLoader:
    return DataLoader(Samples(n), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed),
                      **kwargs)


def buckets_loader(seed: int, n: int = 17) -> DataLoader:
    return DataLoader(Samples(n), batch_sampler=Buckets(n, seed))


def shards(make: Callable[[int], DataLoader], world: int, seed: int, **kwargs: Any) -> list[DataLoaderShard]:
    return [DataLoaderShard(make(seed), None, GradientState(), world, rank, **kwargs) for rank in range(world)]


def as_list(batch: torch.Tensor) -> list[int]:
    return batch.tolist()


def plain_orders(make: Callable[[int], DataLoader], seed: int, epochs: int) -> list[list[list[int]]]:
    """Each epoch's batches as the unprepared loader yields them: the order on any number of ranks."""
    loader = make(seed)
    return [[as_list(b) for b in loader] for _ in range(epochs)]


def deal_samples(order: list[int], start: int, world: int, size: int, pads: bool = True,
                 drop_last: bool = False) -> list[list[list[int]]]:
    """Rounds of the rest order[start:], each a list of per-rank batches (the rule, written out)."""
    rest, per_round = order[start:], size * world
    rounds = len(rest) // per_round if drop_last else math.ceil(len(rest) / per_round)
    dealt = []
    for k in range(rounds):
        chunk = rest[k * per_round:(k + 1) * per_round]
        if pads:
            chunk = chunk + [order[i % len(order)] for i in range(per_round - len(chunk))]
        dealt.append([chunk[r * size:(r + 1) * size] for r in range(world) if chunk[r * size:(r + 1) * size]])
    return dealt


def run_rounds(ranks: list[Any], rounds: int | None, skips: list[int] | None = None) -> list[list[list[int]]]:
    """Takes `rounds` batches (None: all) on every rank in step; returns each round's per-rank batches."""
    passes = [rank.iterate(skip=(skips or [0] * len(ranks))[i]) for i, rank in enumerate(ranks)]
    got: list[list[list[int]]] = []
    while rounds is None or len(got) < rounds:
        batches = [next(p, None) for p in passes]
        if all(b is None for b in batches):
            break
        got.append([as_list(b) for b in batches if b is not None])
    return got


def resume(make: Callable[[int], DataLoader], saved: dict[str, Any], world: int, **kwargs: Any) -> list[Any]:
    """M fresh shards (built from other seeds) that load process 0's saved state."""
    ranks = shards(make, world, seed=999, **kwargs)
    for rank in ranks:
        rank.load_state_dict(saved)
    return ranks


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("cut", [0, 1, 3, "all"])  # "all": every batch taken, the epoch not closed yet
def test_the_rest_of_the_epoch_is_dealt_to_the_new_ranks_then_epochs_go_on_as_on_them(before, after, cut):
    make = samples_loader
    cut = math.ceil(23 / (2 * before)) if cut == "all" else cut
    orders = [[i for b in epoch for i in b] for epoch in plain_orders(make, 5, epochs=2)]
    old = shards(make, before, seed=5)
    first = run_rounds(old, cut)
    assert first == deal_samples(orders[0], 0, before, 2, pads=before > 1)[:cut]
    saved = old[0].state_dict()
    consumed = min(cut * 2 * before, 23)
    assert saved["order_consumed"] == consumed and saved["num_processes"] == before
    assert all(rank.state_dict()["order_consumed"] == consumed for rank in old)

    new = resume(make, saved, after)
    start_batch = math.ceil(consumed / (2 * after))
    assert [rank.position.batches_consumed for rank in new] == [start_batch] * after
    rest = run_rounds(new, None, [rank.position.batches_consumed for rank in new])
    assert rest == deal_samples(orders[0], consumed, after, 2, pads=after > 1)
    # Every sample of the epoch exactly once, padding aside (it repeats the start of the epoch).
    taken = [i for rounds in (first, rest) for batches in rounds for b in batches for i in b]
    assert sorted(taken[:23]) == list(range(23)) and taken[23:] == orders[0][:len(taken) - 23]
    assert all(rank.position.epoch == 1 and rank.position.batches_consumed == 0 for rank in new)
    assert run_rounds(new, None) == deal_samples(orders[1], 0, after, 2, pads=after > 1)


def test_batch_numbers_keep_the_one_process_numbering_for_worker_seeds():
    old = shards(samples_loader, 2, seed=5)
    run_rounds(old, 2)  # 8 samples: batches 0..3 of a one-process run
    new = resume(samples_loader, old[0].state_dict(), 3)
    order = new[1].order.draw(0, replay=True)[1]
    numbers = [k for k, _ in new[1].dealer.deal(new[1].dealer.flatten(order), 0, 8)]
    assert numbers[:2] == [4 + 1, 4 + 1 + 3]  # rank 1 of 3: one-process batches 5, 8, ...


def test_whole_batches_are_dealt_from_the_consumed_batch_count():
    orders = plain_orders(buckets_loader, 3, epochs=2)
    old = shards(buckets_loader, 2, seed=3)
    first = run_rounds(old, 2)  # 4 of the epoch's 9 batches
    saved = old[0].state_dict()
    assert saved["order_consumed"] == 4
    new = resume(buckets_loader, saved, 3)
    rest = run_rounds(new, None, [r.position.batches_consumed for r in new])
    # Batches 4..8 in rounds of 3 ranks; the last round [7, 8, pad] repeats the epoch's first batch.
    want = [[orders[0][4], orders[0][5], orders[0][6]], [orders[0][7], orders[0][8], orders[0][0]]]
    assert rest == want
    assert [b for r in first for b in r] + [b for r in rest for b in r][:5] == orders[0]
    assert run_rounds(new, None) == [orders[1][k:k + 3] for k in (0, 3, 6)]


@pytest.mark.parametrize("kwargs, pads", [(dict(drop_last=True), False), (dict(), False)])
def test_drop_last_and_uneven_batches_deal_the_rest_by_the_same_rule(kwargs, pads):
    make = lambda seed: samples_loader(seed, **kwargs)  # noqa: E731
    order = [i for b in plain_orders(make, 5, epochs=1)[0] for i in b]
    old = shards(make, 2, seed=5, even_batches=False)
    run_rounds(old, 2)
    new = resume(make, old[0].state_dict(), 4, even_batches=False)
    rest = run_rounds(new, None, [r.position.batches_consumed for r in new])
    assert rest == deal_samples(order, 8, 4, 2, pads=False, drop_last=bool(kwargs))


def test_split_batches_keeps_the_global_batch_on_any_number_of_ranks():
    make = lambda seed: samples_loader(seed, n=24, batch_size=4)  # noqa: E731
    order = [i for b in plain_orders(make, 5, epochs=1)[0] for i in b]
    old = shards(make, 2, seed=5, split_batches=True)
    run_rounds(old, 3)
    saved = old[0].state_dict()
    assert saved["order_consumed"] == 12
    new = resume(make, saved, 4, split_batches=True)
    assert [r.position.batches_consumed for r in new] == [3] * 4  # whole rounds: the same batch number
    assert run_rounds(new, None, [3] * 4) == deal_samples(order, 12, 4, 1)


def test_a_checkpoint_within_a_re_dealt_epoch_resumes_exactly_and_re_deals_again():
    """4 ranks resumed from 2 save mid-way; the same 4 resume bitwise, and 3 ranks re-deal the rest."""
    order = [i for b in plain_orders(samples_loader, 5, epochs=1)[0] for i in b]
    old = shards(samples_loader, 2, seed=5)
    run_rounds(old, 3)  # 12 samples
    middle = resume(samples_loader, old[0].state_dict(), 4)
    run_rounds(middle, 1, [2] * 4)  # batch 2 (start) of rounds of 8: samples 12..19
    saved = middle[0].state_dict()
    assert (saved["start_items"], saved["start_batch"], saved["batches_consumed"]) == (12, 2, 3)
    assert saved["order_consumed"] == 20
    again = resume(samples_loader, saved, 4)
    torch.testing.assert_close([r.state_dict() for r in again], [r.state_dict() for r in middle], rtol=0, atol=0)
    assert run_rounds(again, None, [3] * 4) == run_rounds(middle, None, [3] * 4)
    three = resume(samples_loader, saved, 3)
    assert run_rounds(three, None, [4] * 3) == deal_samples(order, 20, 3, 2)


def test_a_skip_of_the_old_runs_batches_is_refused_and_zero_restarts_the_epoch():
    old = shards(samples_loader, 2, seed=5)
    run_rounds(old, 3)
    new = resume(samples_loader, old[0].state_dict(), 4)
    assert new[0].position.batches_consumed == 2
    with pytest.raises(ValueError, match=r"batch 2 \(loader.position.batches_consumed\).*Received: skip=1"):
        next(new[0].iterate(skip=1))
    assert len(SkippedDataLoader(new[0], 2)) == 2  # the 11 samples left in rounds of 8
    # Skip 0: the whole epoch again, dealt to 4 (a fresh draw, as a same-size resume that skips nothing).
    whole = [i for rounds in run_rounds(new, None) for b in rounds for i in b]
    assert len(whole) == 24 and sorted(whole[:23]) == list(range(23)) and whole[23] == whole[0]


def test_a_loader_that_resumes_itself_continues_the_re_dealt_epoch():
    order = [i for b in plain_orders(samples_loader, 5, epochs=1)[0] for i in b]
    old = shards(samples_loader, 4, seed=5)
    run_rounds(old, 1)
    new = shards(samples_loader, 2, seed=9)
    for rank in new:
        rank.resumes_itself = True
        rank.load_state_dict(old[0].state_dict())
    passes = [iter(rank) for rank in new]  # __iter__ skips by itself
    assert [[as_list(b) for b in p] for p in passes] == [list(x) for x in zip(*deal_samples(order, 8, 2, 2))]


def test_an_epoch_finished_but_not_closed_resumes_as_an_empty_pass():
    """Saved after the epoch's last batch (before the loop closed it): nothing is left to deal."""
    old = shards(samples_loader, 2, seed=5)
    run_rounds(old, 6)  # all 6 batches of 23 samples (rounds of 4), the epoch not closed yet
    saved = old[0].state_dict()
    assert saved["epoch"] == 0 and saved["order_consumed"] == 23
    new = resume(samples_loader, saved, 4)
    assert new[0].position.batches_consumed == 3 and run_rounds(new, None, [3] * 4) == []
    assert new[0].position.epoch == 1


def test_ready_batch_lists_are_dealt_again_from_the_consumed_count():
    batches = list(range(11))
    old = [BatchesShard(batches, None, GradientState(), 2, r) for r in range(2)]
    first = run_rounds_plain(old, 3)
    saved = old[0].state_dict()
    assert saved["order_consumed"] == 6 and saved["num_processes"] == 2
    new = [BatchesShard(batches, None, GradientState(), 4, r) for r in range(4)]
    for rank in new:
        rank.load_state_dict(saved)
    rest = run_rounds_plain(new, None, [2] * 4)
    assert first == [[0, 1], [2, 3], [4, 5]] and rest == [[6, 7, 8, 9], [10, 0, 1, 2]]
    assert run_rounds_plain(new, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 0]]


def run_rounds_plain(ranks: list[Any], rounds: int | None, skips: list[int] | None = None) -> list[list[int]]:
    passes = [rank.iterate(skip=(skips or [0] * len(ranks))[i]) for i, rank in enumerate(ranks)]
    got: list[list[int]] = []
    while rounds is None or len(got) < rounds:
        items = [next(p, None) for p in passes]
        if all(i is None for i in items):
            break
        got.append([i for i in items if i is not None])
    return got


def test_a_stream_loads_on_other_ranks_only_between_passes():
    from torch.utils.data import IterableDataset

    class Count(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    def stream(world: int, rank: int) -> StreamShard:
        return StreamShard(DataLoader(Count(), batch_size=2), None, GradientState(), world, rank)

    old = stream(2, 0)
    assert old.state_dict()["order_consumed"] == 0
    it = old.iterate(skip=0)
    next(it)
    under_way = old.state_dict()
    assert under_way["order_consumed"] is None
    with pytest.raises(ValueError, match="order_consumed=None"):
        stream(4, 0).load_state_dict(under_way)
    list(it)
    between = old.state_dict()
    new = stream(4, 1)
    new.load_state_dict(between)
    assert new.position.epoch == 1 and [b.tolist() for b in new.iterate(skip=0)] == [[2, 3]]
