"""Streams on 2 real gloo processes (scripts/stream_worker.py): every sample of a pass used by
exactly one rank, ranks that end together, and Trainer runs that resume bitwise-exactly."""

from __future__ import annotations

from typing import Any

import pytest

from support.jobs import forked, run
from support.results import assert_state_equal, read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def stream_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = shared_folder(tmp_path_factory, "streams",
                        lambda out: run(forked(2, "stream_worker.py", "--out", str(out))).check())
    return read_results(out, 2)


def _pass(job: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return job[0]["passes"][name], job[1]["passes"][name]


@pytest.mark.parametrize("name,count", [("numbers", 23), ("numbers_workers", 23), ("ready", 20)])
def test_every_sample_is_used_once_and_ranks_take_the_same_number_of_steps(
        stream_job: list[dict[str, Any]], name: str, count: int) -> None:
    rank0, rank1 = _pass(stream_job, name)
    assert len(rank0["mine"]) == len(rank1["mine"])  # even_batches: nobody waits for a missing peer
    used = sorted(i for batch in rank0["gathered"] for i in batch)
    assert used == list(range(count))  # 23 and the 20 samples of 7 ready batches: not divisible by 2
    assert rank0["gathered"] == rank1["gathered"]
    # A rank never holds another rank's sample in the same round, except the padding of a short round.
    assert not set(rank0["mine"][0]) & set(rank1["mine"][0])


def test_without_even_batches_nothing_is_repeated(stream_job: list[dict[str, Any]]) -> None:
    rank0, rank1 = _pass(stream_job, "uneven")
    taken = [i for rank in (rank0, rank1) for batch in rank["mine"] for i in batch]
    assert sorted(taken) == list(range(23))


@pytest.mark.parametrize("name", ["own_shards", "hf_split"])
def test_a_stream_that_shards_itself_is_not_sharded_again_and_ranks_stop_together(
        stream_job: list[dict[str, Any]], name: str) -> None:
    rank0, rank1 = _pass(stream_job, name)
    # Rank 0 holds the even samples of 0..20 (11), rank 1 the odd ones (10): both stop after 5 batches.
    assert [i for b in rank0["mine"] for i in b] == list(range(0, 20, 2))
    assert [i for b in rank1["mine"] for i in b] == list(range(1, 20, 2))
    assert any("ran out on another rank" in w for w in rank0["warnings"])
    assert not rank1["warnings"]


@pytest.mark.parametrize("run_name", ["hf_shuffled_0", "hf_shuffled_2", "stateless_0", "stateless_2"])
def test_an_interrupted_trainer_run_on_a_stream_ends_bitwise_identical(
        stream_job: list[dict[str, Any]], run_name: str) -> None:
    for rank in stream_job:
        result = rank["resumes"][run_name]
        assert_state_equal(result["resumed"], result["full"])
    assert_state_equal(stream_job[1]["resumes"][run_name]["full"], stream_job[0]["resumes"][run_name]["full"])
