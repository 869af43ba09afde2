"""Map-style loaders on 2 real gloo processes: one user order dealt across ranks, ready batches
and batch samplers dealt whole, gather_for_metrics counts, and an exact mid-epoch resume.

All of these read one torchrun job (scripts/data_ranks_worker.py). Its ranks seed their RNGs
differently; the expectations come from one plain, unprepared DataLoader seeded as rank 0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from support.jobs import forked, load_script, run
from support.results import read_results

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def worker() -> Any:
    return load_script("data_ranks_worker")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("data_ranks")
    run(forked(2, "data_ranks_worker.py", "--out", str(out))).check()
    return read_results(out, 2)


def plain(loader: DataLoader, epochs: int = 2) -> list[list[list[int]]]:
    return [[b.tolist() for b in loader] for _ in range(epochs)]


def dealt_in_rounds(order: list[int], batch_size: int, rank: int, world: int = 2) -> list[list[int]]:
    """Rank `rank`'s batches of one epoch's sample order, the last round padded from the start."""
    round_size = batch_size * world
    rounds = -(-len(order) // round_size)
    padded = order + order[:rounds * round_size - len(order)]
    return [padded[k * round_size + rank * batch_size:][:batch_size] for k in range(rounds)]


def test_every_rank_deals_rank_0s_order_which_is_the_plain_one_process_order(ranks, worker):
    torch.manual_seed(100)  # rank 0's seed
    want = plain(DataLoader(worker.Samples(20), batch_size=4, shuffle=True))
    rng_after_plain = torch.get_rng_state()
    for rank, facts in enumerate(r["order"] for r in ranks):
        for epoch in range(2):
            flat = [i for b in want[epoch] for i in b]
            assert facts["shuffle"][epoch] == dealt_in_rounds(flat, 4, rank)
    assert ranks[0]["order"]["shuffle"][0] != ranks[0]["order"]["shuffle"][1]  # a new order each epoch
    # Rank 0 consumed its global RNG as the plain loader does; rank 1's stream was left alone.
    assert torch.equal(ranks[0]["order"]["rng_after"], rng_after_plain)
    assert torch.equal(ranks[1]["order"]["rng_after"], ranks[1]["order"]["rng_before"])


def test_a_users_generator_gives_rank_0s_order_and_ends_in_rank_0s_state_everywhere(ranks, worker):
    generator = torch.Generator().manual_seed(7)  # rank 0's generator; rank 1's was seeded 8
    want = plain(DataLoader(worker.Samples(20), batch_size=4, shuffle=True, generator=generator))
    for rank, facts in enumerate(r["order"] for r in ranks):
        assert facts["generator"] == [dealt_in_rounds([i for b in want[e] for i in b], 4, rank) for e in range(2)]
        assert torch.equal(facts["generator_after"], generator.get_state())


def test_a_batch_samplers_batches_go_whole_to_ranks_in_turn(ranks, worker):
    torch.manual_seed(200)
    want = plain(DataLoader(worker.Samples(13), batch_sampler=worker.RandomBuckets(13)))  # 7 batches an epoch
    r0, r1 = (r["order"]["buckets"] for r in ranks)
    for epoch in range(2):
        assert r0[epoch] == want[epoch][0::2]
        assert r1[epoch] == want[epoch][1::2] + [want[epoch][0]]  # the last round padded with batch 0


def test_gather_for_metrics_counts_each_sample_once_for_a_batch_sampler(ranks):
    for facts in (r["gather"]["batch_sampler"] for r in ranks):
        # Rounds [0 1 2 | 3], [4 5 | 6 7 8 9], [10 | padding]: the padding's samples are dropped.
        assert facts["len"] == 3
        assert facts["tensors"] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
        assert facts["objects"] == facts["tensors"]


def test_gather_for_metrics_keeps_only_the_real_ranks_of_ready_batches(ranks):
    for facts in (r["gather"]["batch_size_none"] for r in ranks):
        # Keys [0 | 1], [2 | 3], [4 | padding]; a ready batch's size is known only once loaded.
        assert facts["len"] == 3
        assert facts["tensors"] == [[0, 10, 11], [20, 21, 22, 30], [40, 41]]
        assert facts["objects"] == facts["tensors"]
        assert facts["sums"] == [[0, 21], [63, 30], [81]]  # one value per real rank


def test_a_checkpoint_saved_mid_epoch_resumes_exactly_on_every_rank(ranks):
    for facts in (r["resume"] for r in ranks):
        assert facts["head"] and facts["rest"]
        assert facts["resumed_rest"] == facts["rest"]
        assert facts["resumed_following"] == facts["following"]
    # The ranks dealt one order: together, each epoch's real batches hold every sample once.
    r0, r1 = (r["resume"] for r in ranks)
    epoch1 = [b for k in range(len(r0["head"] + r0["rest"]))
              for b in ((r0["head"] + r0["rest"])[k], (r1["head"] + r1["rest"])[k])][:7]
    assert sorted(i for b in epoch1 for i in b) == list(range(13))
