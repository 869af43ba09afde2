"""The overhead benchmark's workload: a tiny MLP, its data, and the clock every loop ticks.

Every loop of `benchmarks.overhead` trains `TinyMLP` from the same initial weights on the same
batches, served by a source that ticks a `StepClock` per batch (the same code in every loop), so
the intervals between ticks are whole steps. `RunResult` and `quiet_per_step` turn those ticks
into the numbers the table reports.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, default_collate

from benchmarks import loaders
from fittrain import TrainModule

IN_FEATURES, HIDDEN, OUT_FEATURES = 32, 64, 1
BATCH_SIZE = 32
NUM_BATCHES = 128  # per epoch: a default run crosses epoch boundaries, as real runs do
LR, MOMENTUM = 0.01, 0.9
LOGGER_EVERY, CHECKPOINT_EVERY = 50, 500

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- the clock
class StepClock:
    """Timestamps batch hand-outs: the intervals between them are whole steps."""

    __slots__ = ("now", "times")

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.times: list[float] = []

    def tick(self) -> None:
        """Records one batch hand-out (well under a microsecond, the same in every loop)."""
        self.times.append(self.now())

    def intervals(self) -> tuple[float, ...]:
        """Seconds of each step between the first and the last tick."""
        if len(self.times) < 2:
            raise RuntimeError(f"Too few steps to time: {len(self.times)} batch(es). Use --steps 2 or more.")
        return tuple(b - a for a, b in zip(self.times, self.times[1:]))


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One timed run: the duration of each step, the whole call's seconds, and its steps."""

    intervals: tuple[float, ...]
    total: float
    steps: int

    @property
    def per_step(self) -> float:
        """Mean seconds per step over this run's steady state."""
        return sum(self.intervals) / len(self.intervals)

    @property
    def fixed(self) -> float:
        """Seconds outside the steady state: setup and teardown (about 0 for the hand loop)."""
        return max(self.total - self.per_step * self.steps, 0.0)


def quiet_per_step(runs: Sequence[RunResult]) -> float:
    """Mean step time with interference removed: for each step position, the fastest run's time.

    Every run of a loop does the same steps in the same order, so deterministic work (an epoch
    boundary, a Logger write at step 50, a checkpoint at step 500) sits at the same position in
    each run and survives the minimum, while a preemption by another process hits a random step
    of one run and does not. On an idle machine it comes close to the plain mean.
    """
    columns = zip(*(run.intervals for run in runs))
    fastest = [min(column) for column in columns]
    return sum(fastest) / len(fastest)


# --------------------------------------------------------------------------- the workload
class TinyMLP(TrainModule):
    """32→64→64→1, small enough that per-step Python overhead is a visible share of a step.

    The hand loop uses this very class, so every loop runs the same forward and loss; the only
    difference is who calls them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, OUT_FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class TimedCollate:
    """`default_collate` that ticks the clock: the same per-batch cost in every loop."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def __call__(self, samples: list[Any]) -> Any:
        self.clock.tick()
        return default_collate(samples)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Everything a run needs, built once so every run starts from identical weights and data."""

    dataset: TensorDataset
    batches: list[Batch]
    init_state: dict[str, torch.Tensor]
    steps: int
    now: Callable[[], float] = time.perf_counter  # or time.process_time: see --clock

    def clock(self) -> StepClock:
        """A fresh clock for one run."""
        return StepClock(self.now)

    def model(self) -> TinyMLP:
        """A fresh model with the shared initial weights."""
        model = TinyMLP()
        model.load_state_dict(self.init_state)
        return model

    def loader(self, clock: StepClock) -> DataLoader:
        """A real DataLoader that indexes and collates every batch (shuffled, as in training)."""
        torch.manual_seed(0)  # the same shuffle for every run
        return DataLoader(self.dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True,
                          collate_fn=TimedCollate(clock))

    def source(self, mode: str, clock: StepClock) -> Iterable[Batch]:
        """What every loop iterates: a real loader, or the list of pre-built batches itself."""
        if mode == "batched":
            return loaders.batched_loader(self.batches, clock)
        if mode == "stream":
            return loaders.stream_loader(self.dataset, BATCH_SIZE, TimedCollate(clock))
        return self.loader(clock) if mode == "loader" else TimedList(self.batches, clock)


class TimedList:
    """The pre-built batches as a plain iterable; ticks the clock per batch like the loaders do."""

    def __init__(self, batches: list[Batch], clock: StepClock) -> None:
        self.batches = batches
        self.clock = clock

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        tick = self.clock.tick
        for batch in self.batches:
            tick()
            yield batch


def make_workload(steps: int, now: Callable[[], float] = time.perf_counter) -> Workload:
    """Random regression data and one initial set of weights, from fixed seeds."""
    generator = torch.Generator().manual_seed(0)
    n = NUM_BATCHES * BATCH_SIZE
    x = torch.randn(n, IN_FEATURES, generator=generator)
    y = x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=generator)
    batches = [(x[i:i + BATCH_SIZE].clone(), y[i:i + BATCH_SIZE].clone()) for i in range(0, n, BATCH_SIZE)]
    torch.manual_seed(0)
    init_state = {k: v.clone() for k, v in TinyMLP().state_dict().items()}
    return Workload(TensorDataset(x, y), batches, init_state, steps, now)


def cycle(source: Iterable[Batch], steps: int) -> Iterator[Batch]:
    """Epochs of `source` until `steps` batches were yielded (a new iterator per epoch)."""
    done = 0
    while done < steps:
        for batch in source:
            yield batch
            done += 1
            if done == steps:
                return


def result(clock: StepClock, start: float, work: Workload) -> RunResult:
    """The run's step intervals, its whole duration since `start`, and its steps."""
    return RunResult(clock.intervals(), work.now() - start, work.steps)
