"""Per-step time of a 2-process fittrain Accelerator loop against a hand-written DDP loop.

Both loops train the same tiny MLP with SGD on 2 gloo processes on the CPU, one thread each,
with and without gradient accumulation (4 batches per optimizer step). The hand-written loop is
what a PyTorch user writes: DistributedDataParallel, a DistributedSampler, `no_sync()` on the
accumulating batches and a manual loss division. The fittrain loop is the Accelerate-style loop:
`prepare`, `accumulate`, `backward`. Target: fittrain at most 1.05x the hand-written loop.

How it is timed: one torchrun job runs every configuration, alternating hand and fittrain runs
(the order flips each round) so drift on a shared machine hits both alike. A run is one epoch of
`--steps` batches per process between two barriers; building the model, DDP and loaders is
outside the clock. Each configuration first runs once untimed (warm-up), with a DDP comm hook
that counts the all-reduces. The headline is the median time of an optimizer step (divided by
the batches it accumulates) over every timed step: on a busy machine the pauses when a process
is descheduled hit a minority of steps, which the median ignores. Whole-epoch and CPU-time
ratios (medians over rounds) are shown beside it as a cross-check.

Usage:
    python -m benchmarks.ddp                      # one to two minutes on a slow 2-core machine
    python -m benchmarks.ddp --steps 400 --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fittrain.distributed.teardown import leave_process_group

WIDTH, FEATURES, LR = 256, 64, 0.01
ACCUMULATIONS = (1, 4)
LOOPS = ("hand", "fittrain")


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 1))


def _dataset(steps: int, batch: int, world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * batch * world  # one epoch is exactly `steps` batches on every process
    x = torch.randn(n, FEATURES, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _counting_hook(counter: list[int]) -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # No annotations: DDP checks a hook's annotations against dist.GradBucket.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        counter[0] += 1
        return default_hooks.allreduce_hook(None, bucket)

    return hook


def _hand_loop(data: TensorDataset, batch: int, accumulation: int, counter: list[int] | None) -> Iterator[None]:
    """A hand-written DDP loop: yields once when set up, then after every optimizer step."""
    model = DistributedDataParallel(_make_model())
    if counter is not None:
        model.register_comm_hook(None, _counting_hook(counter))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0))
    yield
    for step, (x, y) in enumerate(loader):
        sync = (step + 1) % accumulation == 0
        with contextlib.nullcontext() if sync else model.no_sync():
            (F.mse_loss(model(x), y) / accumulation).backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()
            yield


def _fittrain_loop(data: TensorDataset, batch: int, accumulation: int, counter: list[int] | None) -> Iterator[None]:
    """The same training with fittrain's Accelerator, yielding at the same points."""
    from fittrain import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model = _make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=batch, shuffle=True))
    if counter is not None:
        model.register_comm_hook(None, _counting_hook(counter))
    yield
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            yield


def _run(loop: str, data: TensorDataset, batch: int, accumulation: int, count: bool) -> dict[str, Any]:
    """Times one epoch, barrier to barrier, and each optimizer step in it.

    Returns:
        "run": wall seconds per batch over the epoch; "cpu": this process's CPU seconds per batch
        (all threads; a descheduled process accrues none, so a busy machine inflates it less);
        "steps": wall seconds of each optimizer step; "allreduces": counted when `count`.
    """
    counter = [0] if count else None
    runner = (_hand_loop if loop == "hand" else _fittrain_loop)(data, batch, accumulation, counter)
    next(runner)  # setup, off the clock
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    ticks = [wall]
    for _ in runner:
        ticks.append(time.perf_counter())
    dist.barrier()
    batches = (len(ticks) - 1) * accumulation
    return {"run": (time.perf_counter() - wall) / batches, "cpu": (time.process_time() - cpu) / batches,
            "steps": [b - a for a, b in zip(ticks, ticks[1:])], "allreduces": counter[0] if counter else 0}


def _worker(args: argparse.Namespace) -> None:
    # Imported before the group, torch._dynamo (which DDP imports) holds no reference to it, and the
    # teardown below can end gloo's threads before the interpreter does (fittrain.distributed.teardown
    # says why: otherwise a finished rank can die with SIGABRT at exit on a busy machine).
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo")
    data = _dataset(args.steps, args.batch, dist.get_world_size())
    result: dict[str, Any] = {"allreduces": {}, "run": {}, "cpu": {}, "steps": {}}
    for accumulation in ACCUMULATIONS:
        for loop in LOOPS:
            key = f"{loop}/{accumulation}"
            result["allreduces"][key] = _run(loop, data, args.batch, accumulation, count=True)["allreduces"]
            result["run"][key], result["cpu"][key], result["steps"][key] = [], [], []
    for round_index in range(args.rounds):
        for accumulation in ACCUMULATIONS:
            for loop in LOOPS if round_index % 2 == 0 else reversed(LOOPS):
                timed = _run(loop, data, args.batch, accumulation, count=False)
                key = f"{loop}/{accumulation}"
                result["run"][key].append(timed["run"])
                result["cpu"][key].append(timed["cpu"])
                result["steps"][key] += [t / accumulation for t in timed["steps"]]
    if dist.get_rank() == 0:
        pathlib.Path(args.out).write_text(json.dumps(result))
    leave_process_group()


def _launch(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    # --standalone: torchrun binds a free port itself; one picked here first could be taken meanwhile.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               os.path.abspath(__file__), "--worker", "--out", str(out), "--steps",
               str(args.steps), "--rounds", str(args.rounds), "--batch", str(args.batch)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    subprocess.run(command, env=env, check=True, timeout=1800)
    return json.loads(out.read_text())


def _row(result: dict[str, Any], accumulation: int, steps: int) -> str:
    hand, ours = ({m: result[m][f"{loop}/{accumulation}"] for m in ("run", "cpu", "steps")} for loop in LOOPS)
    step_ms = [statistics.median(t["steps"]) * 1e3 for t in (hand, ours)]
    run_ratio = statistics.median(o / h for o, h in zip(ours["run"], hand["run"]))
    cpu_ratio = statistics.median(o / h for o, h in zip(ours["cpu"], hand["cpu"]))
    counts = [result["allreduces"][f"{loop}/{accumulation}"] for loop in LOOPS]
    expected = steps // accumulation  # one bucket: one all-reduce per optimizer step
    return (f"{accumulation:>5} | {step_ms[0]:>12.3f} | {step_ms[1]:>16.3f} | {step_ms[1] / step_ms[0]:>9.3f}x | "
            f"{run_ratio:>9.3f}x | {cpu_ratio:>9.3f}x | {counts[0]} / {counts[1]} ({expected})")


def _table(result: dict[str, Any], args: argparse.Namespace) -> str:
    return "\n".join([
        f"2 processes (gloo, CPU), MLP {FEATURES}-{WIDTH}-{WIDTH}-1, batch {args.batch}/process, "
        f"{args.steps} batches/run, {args.rounds} rounds per configuration, runs alternating",
        f"{'accum':>5} | {'hand ms/step':>12} | {'fittrain ms/step':>16} | {'ratio':>10} | {'run ratio':>10} | "
        f"{'CPU ratio':>10} | all-reduces hand / fittrain (expected)",
        "-" * 118,
        *(_row(result, accumulation, args.steps) for accumulation in ACCUMULATIONS),
        "ms/step: median over all timed optimizer steps, per batch (robust to a busy machine's pauses); ratio: "
        "fittrain/hand of those.\nrun ratio: median over rounds of whole-epoch time ratios; CPU ratio: the same for "
        "process CPU time. Target: ratio <= 1.05x.",
    ])


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark (or, with --worker, one process of it) and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="batches per process per timed run")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs of each configuration")
    parser.add_argument("--batch", type=int, default=32, help="batch size per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps % max(ACCUMULATIONS):
        parser.error(f"--steps must be a multiple of {max(ACCUMULATIONS)}. Received: --steps {args.steps}.")
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as folder:
        print(_table(_launch(args, pathlib.Path(folder) / "result.json"), args))


if __name__ == "__main__":
    main()
