"""One process of a 2-process job on map-style loaders in the user's order: `data_ranks_worker.py --out DIR`.

Each rank seeds its RNGs differently (as unsynchronised scripts do), then records what its
prepared loaders yield, what gather_for_metrics returns, and how a mid-epoch checkpoint resumes;
it saves the facts to DIR/rank{r}.pt. The tests compare them with one plain, unprepared process
(the datasets and samplers below are imported by the test for that).
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fittrain import Accelerator


class Samples(Dataset):
    """Sample i is tensor(i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class ReadyBatches(Dataset):
    """Key k is a whole batch of 1 to 3 samples: 10k, 10k+1, ..."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, key: int) -> np.ndarray:
        return np.arange(10 * key, 10 * key + 1 + key % 3)


class RandomBuckets(Sampler):
    """A batch sampler that shuffles with the global RNG into batches of 3, 1, 2, 3, ... indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _cuts(self):
        start, k = 0, 0
        while start < self.n:
            yield start, [3, 1, 2][k % 3]
            start, k = start + [3, 1, 2][k % 3], k + 1

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        for start, size in self._cuts():
            yield order[start:start + size]

    def __len__(self) -> int:
        return len(list(self._cuts()))


#: A batch sampler's batches for the gather test: 5 batches (odd), 11 samples.
FIXED = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


class FixedBatches(Sampler):
    def __iter__(self):
        return iter([list(b) for b in FIXED])

    def __len__(self) -> int:
        return len(FIXED)


def lists(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def order_facts(rank: int) -> dict[str, Any]:
    """Two epochs of a shuffled loader, a generator's loader and a batch sampler, with each rank's
    global RNG seeded differently; and what each pass left in the RNGs."""
    acc = Accelerator()
    torch.manual_seed(100 + rank)
    shuffled = acc.prepare(DataLoader(Samples(20), batch_size=4, shuffle=True))
    rng_before = torch.get_rng_state()
    facts: dict[str, Any] = {"shuffle": [lists(shuffled) for _ in range(2)], "rng_before": rng_before,
                             "rng_after": torch.get_rng_state()}
    generator = torch.Generator().manual_seed(7 + rank)
    with_generator = acc.prepare(DataLoader(Samples(20), batch_size=4, shuffle=True, generator=generator))
    facts["generator"] = [lists(with_generator) for _ in range(2)]
    facts["generator_after"] = generator.get_state()
    torch.manual_seed(200 + rank)
    buckets = acc.prepare(DataLoader(Samples(13), batch_sampler=RandomBuckets(13)))
    facts["buckets"] = [lists(buckets) for _ in range(2)]
    return facts


def gather_facts() -> dict[str, Any]:
    """gather_for_metrics over one epoch of a batch_sampler loader and of a batch_size=None loader,
    both with an odd number of batches, so the last round is padded with a whole batch."""
    acc = Accelerator()
    out: dict[str, Any] = {}
    for name, loader in (("batch_sampler", DataLoader(Samples(11), batch_sampler=FixedBatches())),
                         ("batch_size_none", DataLoader(ReadyBatches(), batch_size=None))):
        prepared = acc.prepare(loader)
        tensors, objects, sums = [], [], []
        for batch in prepared:
            tensors.append(acc.gather_for_metrics(batch).tolist())
            objects.append(acc.gather_for_metrics(batch.tolist(), use_gather_object=True))
            sums.append(acc.gather_for_metrics(batch.sum()).tolist())  # one 0-d value per rank and batch
        out[name] = {"tensors": tensors, "objects": objects, "sums": sums, "len": len(prepared)}
    return out


def resume_facts(rank: int, folder: pathlib.Path) -> dict[str, Any]:
    """Saves in the middle of epoch 1, then resumes in a fresh Accelerator seeded differently."""
    def make() -> DataLoader:
        return DataLoader(Samples(13), batch_sampler=RandomBuckets(13))

    acc = Accelerator()
    torch.manual_seed(300 + rank)
    loader = acc.prepare(make())
    lists(loader)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    acc.save_state(str(folder))
    rest = [b.tolist() for b in iterator]
    following = lists(loader)

    torch.manual_seed(999 + rank)
    again = Accelerator()
    resumed = again.prepare(make())
    again.load_state(str(folder))
    resumed_rest = lists(again.skip_first_batches(resumed, resumed.position.batches_consumed))
    return {"head": head, "rest": rest, "following": following, "resumed_rest": resumed_rest,
            "resumed_following": lists(resumed)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    rank = Accelerator().process_index
    result = {"rank": rank, "order": order_facts(rank), "gather": gather_facts(),
              "resume": resume_facts(rank, out / "checkpoint")}
    torch.save(result, out / f"rank{rank}.pt")
    Accelerator().end_training()


if __name__ == "__main__":
    main()
