"""Streams for the stream tests (tests/data/: test_streams.py and test_stream_trainer.py on one
process, stream_worker.py on two).

Sample i of every stream carries its index, so a test can tell exactly which samples a rank
used. Each stream splits itself among DataLoader workers (sample i goes to worker i % W), as a
plain PyTorch IterableDataset must.
"""

from __future__ import annotations

import math
import pathlib
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Checkpointer


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i: 3 features made from i (the first is i itself) and a target."""
    x = torch.tensor([float(i), math.sin(i), math.cos(0.5 * i)])
    return x, torch.tensor([math.sin(x[1].item() + x[2].item())])


def _my_indices(n: int) -> range:
    info = get_worker_info()
    return range(info.id, n, info.num_workers) if info is not None else range(n)


class Numbers(IterableDataset):
    """Samples 0..n-1, with no state: a resumed pass replays it (exact, since it is deterministic)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in _my_indices(self.n):
            yield sample(i)


class StatefulNumbers(Numbers):
    """Samples 0..n-1 that report and restore their position (the state_dict protocol)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.done, self.start = 0, 0

    def __iter__(self):
        mine = list(_my_indices(self.n))
        self.done, start, self.start = self.start, self.start, 0
        for i in mine[start:]:
            self.done += 1
            yield sample(i)

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["done"]


class ReadyBatches(IterableDataset):
    """A stream of `count` ready batches; batch k holds the k % 3 + 2 samples that follow batch k-1."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        starts = [0]
        for k in range(self.count):
            starts.append(starts[-1] + k % 3 + 2)
        for k in _my_indices(self.count):
            xs, ys = zip(*(sample(i) for i in range(starts[k], starts[k + 1])))
            yield torch.stack(xs), torch.stack(ys)


class OwnShards(Numbers):
    """Yields only this rank's samples by itself (rank r: every size-th sample from `first`), so
    fittrain must not shard it again; `first` lets ranks hold different counts."""

    shards_by_rank = True

    def __init__(self, n: int, rank: int, size: int) -> None:
        super().__init__(n)
        self.rank, self.size = rank, size

    def __iter__(self):
        for i in _my_indices(self.n):
            if i % self.size == self.rank:
                yield sample(i)


def hugging_face(n: int, shards: int, buffer_size: int | None = None, rank: int | None = None,
                 world: int | None = None) -> Any:
    """A Hugging Face `datasets.IterableDataset` of samples 0..n-1, built locally (no download),
    optionally shuffled with a buffer and split by rank with split_dataset_by_node."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    xs, ys = zip(*(sample(i) for i in range(n)))
    table = datasets.Dataset.from_dict({"x": [x.tolist() for x in xs], "y": [y.tolist() for y in ys]})
    stream = table.to_iterable_dataset(num_shards=shards)
    if buffer_size:
        stream = stream.shuffle(seed=7, buffer_size=buffer_size)
    if rank is not None:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return stream.with_format("torch")


def indices(batch: Any) -> list[int]:
    """The sample indices in a batch (a (x, y) pair or a {"x", "y"} dict)."""
    x = batch["x"] if isinstance(batch, dict) else batch[0]
    return [int(v) for v in x[:, 0].tolist()]


class Regressor(TrainModule):
    """A small MLP over the 3 features; dropout makes the global RNG matter for exact resume."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
        return nn.functional.mse_loss(self(x / 40.0), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(make_loader: Callable[[], DataLoader], project_dir: str | pathlib.Path, max_steps: int,
        resume_from: str | None = None, every_n_steps: int | None = None) -> dict[str, torch.Tensor]:
    """Trains a fresh Regressor (seeded) on a fresh loader and returns its final weights."""
    torch.manual_seed(0)
    module = Regressor()
    callbacks = [Checkpointer(every_n_steps=every_n_steps)] if every_n_steps else []
    trainer = Trainer(max_steps=max_steps, project_dir=project_dir, resume_from=resume_from, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stateless stream warns on resume; the tests check that apart
        trainer.fit(module, make_loader())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def interrupted_fit(make_loader: Callable[[], DataLoader], project_dir: pathlib.Path, stop_at: int,
                    max_steps: int) -> dict[str, torch.Tensor]:
    """Trains to `stop_at` saving every step, then resumes from that checkpoint in a new Trainer."""
    fit(make_loader, project_dir, stop_at, every_n_steps=1)
    return fit(make_loader, project_dir, max_steps, resume_from="latest")
