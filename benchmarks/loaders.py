"""The loaders users bring beyond a batching DataLoader, as workloads for `benchmarks.overhead`.

Two more batch modes for the overhead table, each a real `DataLoader` that every loop iterates
(the hand loop unprepared, the Accelerator loop and `Trainer.fit` prepared):

- **batch_size=None**: a map-style dataset whose items are the pre-built batches, read by
  `DataLoader(dataset, batch_size=None, shuffle=True)`; the collate function hands each batch on
  as it is and ticks the clock.
- **IterableDataset**: a stream of the samples of the DataLoader mode's dataset, in a fixed
  shuffled order, batched by `DataLoader(stream, batch_size=32)`; the collate function ticks.

And the workers row (`--workers-row`): samples per second of `Trainer.fit` against the hand loop
over the same `DataLoader(stream, batch_size=32, num_workers=2)`. The stream splits itself over
the workers by `get_worker_info()`, as plain PyTorch asks. Worker processes cannot tick the main
process's clock, so here a forward pre-hook on the model ticks it: both loops call the model once
per step. Samples per second count the steps between the first and the last tick, so the first
worker start-up is left out, while the restarts at each epoch (which both loops pay) stay in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

WORKERS = 2
WORKERS_TARGET = 0.95  # Trainer.fit's samples/s at least 95% of the hand loop's


class Clock(Protocol):
    def tick(self) -> None: ...


class ReadyBatches(Dataset):
    """A map-style dataset whose items are whole batches, for `DataLoader(batch_size=None)`."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]


class TimedPassThrough:
    """The collate function of a `batch_size=None` loader: ticks and hands the batch on as it is."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __call__(self, batch: Any) -> Any:
        self.clock.tick()
        return batch


class SampleStream(IterableDataset):
    """The samples of a TensorDataset as a stream, in one fixed shuffled order, each pass alike.

    Under DataLoader workers each worker yields every `num_workers`-th sample from its id on.
    """

    def __init__(self, dataset: TensorDataset, seed: int = 0) -> None:
        self.dataset = dataset
        generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        dataset = self.dataset
        for index in self.order[start::step]:
            yield dataset[index]


def batched_loader(batches: Sequence[Any], clock: Clock) -> DataLoader:
    """`DataLoader(ReadyBatches(batches), batch_size=None, shuffle=True)`, the same order every run."""
    torch.manual_seed(0)
    return DataLoader(ReadyBatches(batches), batch_size=None, shuffle=True, collate_fn=TimedPassThrough(clock))


def stream_loader(dataset: TensorDataset, batch_size: int, collate_fn: Callable[[list[Any]], Any],
                  num_workers: int = 0) -> DataLoader:
    """A DataLoader batching a `SampleStream` of `dataset` (whole batches only, as the map-style mode)."""
    torch.manual_seed(0)
    return DataLoader(SampleStream(dataset), batch_size=batch_size, drop_last=True, collate_fn=collate_fn,
                      num_workers=num_workers)


# --------------------------------------------------------------------------- the workers row
class Work(Protocol):
    """What the workers row needs of `benchmarks.workload.Workload`."""

    dataset: TensorDataset
    steps: int

    def model(self) -> nn.Module: ...


@dataclasses.dataclass(frozen=True)
class Throughput:
    """One run: the tick times of its steps."""

    times: tuple[float, ...]
    batch_size: int

    @property
    def samples_per_s(self) -> float:
        """Samples per second between the first and the last step."""
        if len(self.times) < 2:
            raise RuntimeError(f"Too few steps to time: {len(self.times)}. Use --steps 2 or more.")
        return (len(self.times) - 1) * self.batch_size / (self.times[-1] - self.times[0])


def _ticking_model(work: Work, times: list[float]) -> nn.Module:
    model = work.model()
    model.register_forward_pre_hook(lambda module, args: times.append(time.perf_counter()))
    return model


def _workers_loader(work: Work, batch_size: int) -> DataLoader:
    return stream_loader(work.dataset, batch_size, torch.utils.data.default_collate, WORKERS)


def run_hand_workers(work: Work, batch_size: int) -> Throughput:
    """The hand loop over the unprepared worker loader, epoch after epoch until `work.steps`."""
    times: list[float] = []
    model = _ticking_model(work, times)
    optimizer = model.configure_optimizers()
    loader = _workers_loader(work, batch_size)
    done = 0
    while done < work.steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            done += 1
            if done == work.steps:
                break
    return Throughput(tuple(times), batch_size)


def run_fit_workers(work: Work, batch_size: int) -> Throughput:
    """`Trainer.fit(max_steps=work.steps)`, no callbacks, over the same worker loader."""
    from fittrain import Trainer

    times: list[float] = []
    model = _ticking_model(work, times)
    project = tempfile.mkdtemp(prefix="fittrain-bench-")
    try:
        trainer = Trainer(max_steps=work.steps, project_dir=project)
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            trainer.fit(model, _workers_loader(work, batch_size))
    finally:
        shutil.rmtree(project, ignore_errors=True)
    return Throughput(tuple(times), batch_size)


def _timed(run: Callable[[Work, int], Throughput], work: Work, batch_size: int) -> Throughput:
    gc.collect()
    return run(work, batch_size)


def measure_workers(work: Work, batch_size: int, repeats: int, log: Callable[[str], None]) -> str:
    """Alternates H F H F ... H and reports samples/s of each loop and their ratio, as markdown."""
    _timed(run_hand_workers, work, batch_size)  # warm: lazy imports, the first fork
    _timed(run_fit_workers, work, batch_size)
    hand = [_timed(run_hand_workers, work, batch_size)]
    fit, pairs = [], []
    for round_index in range(repeats):
        fit.append(_timed(run_fit_workers, work, batch_size))
        hand.append(_timed(run_hand_workers, work, batch_size))
        around = (hand[-2].samples_per_s + hand[-1].samples_per_s) / 2
        pairs.append(fit[-1].samples_per_s / around)
        log(f"workers round {round_index + 1}/{repeats} done")
    return format_workers(hand, fit, pairs, work.steps, repeats)


def format_workers(hand: Sequence[Throughput], fit: Sequence[Throughput], pairs: Sequence[float], steps: int,
                   repeats: int) -> str:
    """The workers table: best and median samples/s of each loop, and Trainer.fit over the hand loop."""
    best_ratio = max(r.samples_per_s for r in fit) / max(r.samples_per_s for r in hand)
    verdict = f"≥{WORKERS_TARGET:.2f}× {'✅' if best_ratio >= WORKERS_TARGET else '❌'}"
    lines = [f"Samples/s over DataLoader(IterableDataset, batch_size={hand[0].batch_size}, num_workers={WORKERS}), "
             f"{steps} steps per run, {repeats} alternating rounds, wall clock.", "",
             "| loop | best samples/s | median samples/s | × hand, best | × hand, median of pairs | target |",
             "|---|---:|---:|---:|---:|---|"]
    for name, runs in (("hand-written loop (baseline)", hand), ("fittrain Trainer.fit, no callbacks", fit)):
        rates = [r.samples_per_s for r in runs]
        ratio, pair, target = (1.0, 1.0, "") if runs is hand else (best_ratio, statistics.median(pairs), verdict)
        lines.append(f"| {name} | {max(rates):.0f} | {statistics.median(rates):.0f} | {ratio:.3f}× | {pair:.3f}× | "
                     f"{target} |")
    lines += ["", "Best: the fastest run of each loop (a shared machine only slows runs down); median of pairs: each "
              "Trainer.fit run over the mean of the hand runs just before and after it."]
    return "\n".join(lines)
