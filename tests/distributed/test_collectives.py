"""Collectives on one process, and the pieces of their multi-process logic that need no peers.

Real 2-process collectives are tested in tests/distributed/test_distributed_collectives.py.
"""

from __future__ import annotations

import collections

import pytest
import torch

from fittrain.distributed import collectives
from fittrain.distributed.process_state import ProcessState

ONE = ProcessState(1, 0, 0, torch.device("cpu"), None)
Pair = collections.namedtuple("Pair", "left right")


def _rank(index: int, world: int) -> ProcessState:
    # split_between_processes only reads rank and world size, so no process group is needed.
    return ProcessState(world, index, index, torch.device("cpu"), "gloo")


def test_one_process_collectives_return_their_input() -> None:
    data = {"x": torch.arange(3), "pair": Pair(torch.ones(1), [torch.zeros(2)])}
    assert collectives.gather(data, ONE) is data
    assert collectives.gather_object("anything", ONE) == ["anything"]
    assert collectives.broadcast(data, ONE) is data
    assert collectives.broadcast_object({"a": 1}, ONE) == {"a": 1}
    assert collectives.pad_across_processes(data, ONE) is data


def test_reduce_keeps_structure_and_scales() -> None:
    data = {"x": torch.tensor([2.0, 4.0]), "pair": Pair(torch.tensor(1.0), torch.tensor(3.0))}
    summed = collectives.reduce(data, ONE, "sum", scale=0.5)
    assert torch.equal(summed["x"], torch.tensor([1.0, 2.0]))
    assert isinstance(summed["pair"], Pair) and summed["pair"].right.item() == 1.5
    mean = collectives.reduce(torch.tensor([2.0]), ONE, "mean")
    assert torch.equal(mean, torch.tensor([2.0]))


def test_reduce_rejects_unknown_reductions() -> None:
    with pytest.raises(ValueError, match="Received: reduction='median'"):
        collectives.reduce(torch.ones(1), ONE, "median")


def test_non_tensors_are_a_type_error_pointing_at_gather_object() -> None:
    with pytest.raises(TypeError, match="Received an object of type str.*gather_object"):
        collectives.reduce({"x": "text"}, ONE)


@pytest.mark.parametrize("world, expected", [
    (3, [[0, 1, 2], [3, 4], [5, 6]]),
    (2, [[0, 1, 2, 3], [4, 5, 6]]),
    (8, [[0], [1], [2], [3], [4], [5], [6], []]),
])
def test_split_between_processes_shares_differ_by_at_most_one(world: int, expected: list[list[int]]) -> None:
    shares = []
    for rank in range(world):
        with collectives.split_between_processes(list(range(7)), _rank(rank, world)) as share:
            shares.append(share)
    assert shares == expected


def test_split_between_processes_pads_tensors_and_dicts() -> None:
    inputs = {"ids": torch.arange(5), "names": ["a", "b", "c", "d", "e"]}
    shares = []
    for rank in range(2):
        with collectives.split_between_processes(inputs, _rank(rank, 2), apply_padding=True) as share:
            shares.append(share)
    assert torch.equal(shares[1]["ids"], torch.tensor([3, 4, 4]))
    assert shares[1]["names"] == ["d", "e", "e"]
    assert shares[0]["names"] == ["a", "b", "c"]


def test_mismatched_shapes_and_dtypes_are_named() -> None:
    with pytest.raises(ValueError, match=r"Received rank 0: \[2, 3\], rank 1: \[2, 4\]"):
        collectives._check_gatherable([(2, 3), (2, 4)], ["torch.float32"] * 2)
    with pytest.raises(ValueError, match="Received rank 0: torch.float32, rank 1: torch.int64"):
        collectives._check_gatherable([(2,), (5,)], ["torch.float32", "torch.int64"])
    collectives._check_gatherable([(2, 3), (0, 3)], ["torch.float32"] * 2)  # first dims may differ
