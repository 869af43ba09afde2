"""One process of the 2-process stream job: `stream_worker.py --out DIR`.

Saves, per rank, to DIR/rank{r}.pt: the sample indices of every batch this rank took and what
gather_for_metrics returned for it, for several streams; and the final weights of Trainer runs
on streams, uninterrupted and interrupted-then-resumed.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from fittrain import Accelerator
from stream_data import Numbers, OwnShards, ReadyBatches, fit, hugging_face, indices, interrupted_fit


def one_pass(acc: Accelerator, loader: DataLoader, even_batches: bool = True) -> dict[str, Any]:
    prepared = acc.prepare_data_loader(loader, even_batches=even_batches)
    mine, gathered = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in prepared:
            mine.append(indices(batch))
            gathered.append(acc.gather_for_metrics(torch.tensor(indices(batch))).tolist())
    return {"mine": mine, "gathered": gathered, "warnings": [str(w.message) for w in caught]}


def passes(acc: Accelerator) -> dict[str, Any]:
    rank, world = acc.process_index, acc.num_processes
    return {
        "numbers": one_pass(acc, DataLoader(Numbers(23), batch_size=4)),
        "numbers_workers": one_pass(acc, DataLoader(Numbers(23), batch_size=4, num_workers=2)),
        "ready": one_pass(acc, DataLoader(ReadyBatches(7), batch_size=None)),
        "uneven": one_pass(acc, DataLoader(Numbers(23), batch_size=4), even_batches=False),
        "own_shards": one_pass(acc, DataLoader(OwnShards(21, rank, world), batch_size=2)),
        "hf_split": one_pass(acc, DataLoader(hugging_face(21, shards=3, rank=rank, world=world), batch_size=2)),
    }


RESUMED = {
    "hf_shuffled": lambda w: DataLoader(hugging_face(41, shards=4, buffer_size=6), batch_size=4, num_workers=w),
    "stateless": lambda w: DataLoader(Numbers(41), batch_size=4, num_workers=w),
}


def resumes(out: pathlib.Path) -> dict[str, Any]:
    results = {}
    for name, make in RESUMED.items():
        for workers in (0, 2):
            folder = out / f"{name}_{workers}"
            loader = functools.partial(make, workers)
            results[f"{name}_{workers}"] = {"full": fit(loader, folder / "full", 12),
                                            "resumed": interrupted_fit(loader, folder / "resumed", 5, 12)}
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    acc = Accelerator()
    result = {"rank": acc.process_index, "passes": passes(acc), "resumes": resumes(out)}
    torch.save(result, out / f"rank{acc.process_index}.pt")
    dist.barrier()
