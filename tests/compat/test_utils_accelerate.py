"""`fittrain.utils` and `PartialState`: the helpers Accelerate scripts import, on one process.

The 2-process behaviour (collectives, decorators, triggers) is in tests/compat/test_partial_state.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import fittrain
from fittrain import Accelerator, PartialState
from fittrain.utils import (
    find_executable_batch_size,
    gather_object,
    reduce,
    send_to_device,
    set_seed,
    skip_first_batches,
    tqdm,
)


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(()).item()


def test_set_seed_seeds_random_numpy_and_torch_alike() -> None:
    set_seed(7)
    first = _draws()
    set_seed(7, device_specific=True)  # process 0: the same seed
    assert _draws() == first
    set_seed(8)
    assert _draws() != first
    with pytest.raises(TypeError, match=r"`seed` must be an integer. Received: seed='7'"):
        set_seed("7")


def test_partial_state_is_a_read_only_view_that_agrees_with_the_accelerator() -> None:
    state, acc = PartialState(cpu=True), Accelerator(cpu=True)
    assert (state.num_processes, state.process_index, state.device) == (acc.num_processes, acc.process_index,
                                                                        acc.device)
    assert state.is_main_process and state.is_last_process and not state.use_distributed
    with pytest.raises(AttributeError, match="read-only view"):
        state.process_index = 3


def test_one_process_collectives_and_tqdm() -> None:
    assert gather_object(["a"]) == ["a"]
    assert reduce(torch.tensor([2.0]), reduction="max").tolist() == [2.0]
    with pytest.raises(ValueError, match="`reduction` must be one of 'sum', 'mean', 'max', 'min', 'none'"):
        reduce(torch.tensor([2.0]), reduction="median")
    assert not tqdm(range(3)).disable  # the main process shows its bar


def test_send_to_device_skips_the_named_keys() -> None:
    batch = {"x": torch.ones(2), "keep": torch.zeros(2, device="meta")}
    moved = send_to_device(batch, "cpu", skip_keys="keep")
    assert moved["x"].device.type == "cpu" and moved["keep"].device.type == "meta"


class _Counting(Dataset):
    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


def test_skip_first_batches_of_a_plain_loader_keeps_its_order_and_loads_nothing_skipped() -> None:
    dataset = _Counting()
    full = [b.tolist() for b in DataLoader(dataset, batch_size=3, shuffle=True,
                                           generator=torch.Generator().manual_seed(0))]
    dataset.loaded.clear()
    skipped = skip_first_batches(DataLoader(dataset, batch_size=3, shuffle=True,
                                            generator=torch.Generator().manual_seed(0)), num_batches=2)
    assert [b.tolist() for b in skipped] == full[2:] and len(skipped) == 2
    assert sorted(dataset.loaded) == sorted(i for b in full[2:] for i in b)  # the first two never loaded
    assert fittrain.skip_first_batches is skip_first_batches
    with pytest.raises(ValueError, match="`num_batches` must be a non-negative integer. Received: num_batches=-1"):
        skip_first_batches([], num_batches=-1)
    for bad in ("3", 1.5, True):  # the same check as the Accelerator's method, at the call
        with pytest.raises(TypeError, match="`num_batches` must be a non-negative integer"):
            skip_first_batches([], num_batches=bad)


def test_skip_first_batches_of_a_stream_and_a_prepared_loader() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(7))

    assert [b.tolist() for b in skip_first_batches(DataLoader(Stream(), batch_size=2), 2)] == [[4, 5], [6]]
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(list(range(8)), batch_size=2))
    assert [b.tolist() for b in skip_first_batches(loader, 3)] == [[6, 7]]


def test_find_executable_batch_size_shrinks_on_out_of_memory_only() -> None:
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 60:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    assert train(2) == 116 and tried == [128, 115, 103, 92, 82, 73, 65, 58]

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size: int) -> None:
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    with pytest.raises(TypeError, match="passes it as the first argument"):
        train(64, 2)

    @find_executable_batch_size(starting_batch_size=2)
    def never(batch_size: int) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    with pytest.raises(RuntimeError, match="reached zero"):
        never()


def test_accelerator_decorators_and_triggers_on_one_process() -> None:
    acc = Accelerator(cpu=True)
    calls = []
    acc.on_main_process(lambda: calls.append("main"))()
    acc.on_process(process_index=1)(lambda: calls.append("one"))()
    assert calls == ["main"] and acc.is_last_process
    assert not acc.check_trigger()
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()
    with pytest.raises(ValueError, match="`process_index` must be a process index"):
        acc.on_process(process_index=None)
