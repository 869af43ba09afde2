"""One process of a multi-process DDP job that checks many things in a single launch.

Run under torchrun or `fittrain launch`: `ddp_worker.py --out DIR [--scenarios a,b] [extra args]`.
Each scenario returns plain facts; each rank saves them to DIR/rank{r}.pt and the tests compare
the ranks, and compare against a 1-process reference. Collectives must line up across ranks, so
every scenario runs on every rank, in the same order.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import pathlib
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import training
from fittrain import Accelerator
from fittrain.checkpoint import CheckpointWriter


def facts(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """What the Accelerator reports about this process, and what the launcher passed on."""
    acc = Accelerator()
    return {
        "num_processes": acc.num_processes, "process_index": acc.process_index,
        "local_process_index": acc.local_process_index, "is_main_process": acc.is_main_process,
        "is_local_main_process": acc.is_local_main_process, "distributed_type": str(acc.distributed_type.value),
        "device": str(acc.device), "backend": dist.get_backend(), "world_size": dist.get_world_size(),
        "env_rank": os.environ["RANK"], "group_rank": os.environ.get("GROUP_RANK"),
        "strategy_env": os.environ.get("FITTRAIN_STRATEGY"), "script_args": extra,
    }


def _count_allreduces(log: list[int]) -> Callable[[nn.Module, dict[str, int]], None]:
    def register(model: nn.Module, progress: dict[str, int]) -> None:
        # No annotations: DDP checks them against dist.GradBucket, and this file's
        # `from __future__ import annotations` would turn them into strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            log.append(progress["batch"])  # which batch triggered an all-reduce
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, hook)

    return register


def ddp_runs(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """training.RUNS under DDP, with the batches whose backward all-reduced gradients."""
    results = {}
    for name, (batch, n, accumulation) in training.RUNS.items():
        acc = Accelerator(gradient_accumulation_steps=accumulation)
        log: list[int] = []
        params = training.train(acc, batch, n, on_prepared=_count_allreduces(log))
        results[name] = {"params": params, "allreduce_batches": sorted(set(log)),
                         "model_type": type(acc.prepared.models[0]).__name__,
                         "unwrapped_type": type(acc.unwrap_model(acc.prepared.models[0])).__name__}
    return results


def _metrics_pass(acc: Accelerator, n: int, batch: int) -> list[int]:
    """gather_for_metrics over a prepared loader of arange(n), batch by batch."""
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch))
    seen = [acc.gather_for_metrics(x) for (x,) in loader]
    return torch.cat(seen).tolist() if seen else []


def _nested_metrics_pass(acc: Accelerator) -> dict[str, list[int]]:
    """gather_for_metrics over arange(27) (batch 4) with a whole inner loader (an evaluation loop over
    arange(10)) run inside every outer batch, before the outer batch's gather."""
    outer = acc.prepare(DataLoader(TensorDataset(torch.arange(27)), batch_size=4))
    inner = acc.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    seen, inner_seen = [], []
    for (x,) in outer:
        inner_seen = [y for (y,) in inner for y in acc.gather_for_metrics(y).tolist()]
        seen += acc.gather_for_metrics(x).tolist()
    return {"outer": seen, "inner": inner_seen}


def _local_then_gather(acc: Accelerator, n: int, batch: int) -> dict[str, Any]:
    """even_batches=False: collect locally, gather once at the end (no per-batch collective)."""
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch))
    local = [x for (x,) in loader]
    mine = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
    acc.wait_for_everyone()
    return {"len": len(loader), "local": mine.tolist(), "gathered": acc.gather(mine).tolist()}


def metrics(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """gather_for_metrics and uneven data, including fewer batches than processes."""
    even = Accelerator(even_batches=True)
    uneven = Accelerator(even_batches=False)
    return {
        "even_27": _metrics_pass(even, 27, 4),
        "nested_27": _nested_metrics_pass(even),
        "uneven_27": _local_then_gather(uneven, 27, 4),
        "even_3": _metrics_pass(even, 3, 4),
        "uneven_3": _local_then_gather(uneven, 3, 4),
        "few_batches_step": _few_batches_step(),
        "split_16": _split_batches(),
    }


def _split_batches() -> dict[str, Any]:
    """split_batches=True: each loader batch of 8 is split into 4 per rank."""
    acc = Accelerator(split_batches=True)
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(16)), batch_size=8))
    local, gathered = [], []
    for (x,) in loader:
        local.append(x.tolist())
        gathered += acc.gather_for_metrics(x).tolist()
    return {"local": local, "gathered": gathered}


def _few_batches_step() -> dict[str, Any]:
    """3 samples, batch 4, 2 processes, even_batches=True: one DDP step on every rank."""
    acc = Accelerator()
    model = training.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=training.LR)
    model, optimizer, loader = acc.prepare(model, optimizer, training.make_loader(3, 4, shuffle=False))
    steps = 0
    for x, y in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return {"steps": steps, "params": acc.get_state_dict(model)}


def collectives(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """The collectives' results on this rank, including gather's error for mismatched shapes."""
    acc = Accelerator()
    rank = acc.process_index
    results: dict[str, Any] = {}
    mismatched = {"shape": torch.zeros(2, 3 + rank),
                  "dtype": torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.int64)}
    for name, tensor in mismatched.items():
        try:
            acc.gather(tensor)
            results[f"mismatch_{name}"] = "no error"
        except ValueError as error:
            results[f"mismatch_{name}"] = str(error)
    # The group must still be in step after those errors: the next collectives succeed.
    results["gather_nested"] = acc.gather({"a": torch.tensor([rank]), "b": [torch.full((2, 2), float(rank))]})
    results["gather_scalar"] = acc.gather(torch.tensor(float(rank)))
    results["reduce_sum"] = acc.reduce(torch.tensor([1.0, rank]), "sum")
    results["reduce_mean"] = acc.reduce(torch.tensor([1.0, rank]), "mean")
    results["broadcast_tensor"] = acc.broadcast(torch.tensor([rank + 10]), from_process=1)
    results["broadcast_object"] = acc.broadcast({"stop": rank == 1}, from_process=1)
    results["padded"] = acc.pad_across_processes(torch.ones(rank + 1, 2), dim=0, pad_index=-1)
    with acc.split_between_processes(list(range(5))) as share:
        results["split"] = share
    results["main_first_order"] = _main_process_first_order(acc, out)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        acc.print("hello from", rank)
    results["printed"] = printed.getvalue()
    return results


def _main_process_first_order(acc: Accelerator, out: pathlib.Path) -> list[str]:
    """Who entered the main_process_first block first, read back from a shared file."""
    log = out / "main_first.log"
    with acc.main_process_first():
        if acc.is_main_process:
            time.sleep(0.3)  # were the others not held back, they would write first
        with open(log, "a") as f:
            f.write(f"{acc.process_index}\n")
    acc.wait_for_everyone()
    return log.read_text().split()


def _record_writes(written: list[str]) -> None:
    original = CheckpointWriter._write_file

    def recording(self: CheckpointWriter, name: str, fill: Any) -> None:
        written.append(name)
        original(self, name, fill)

    CheckpointWriter._write_file = recording  # type: ignore[method-assign]


def _epoch(acc: Accelerator, model: nn.Module, optimizer: Any, loader: Any) -> dict[str, Any]:
    for x, y in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return {"params": {k: v.clone() for k, v in acc.get_state_dict(model).items()}, "draw": torch.rand(3)}


def checkpoint(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """save_state then load_state: the epoch after each is identical, bit for bit."""
    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(training.N_FEATURES, 16), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer, loader = acc.prepare(model, optimizer, training.make_loader(32, 4))
    _epoch(acc, model, optimizer, loader)
    torch.manual_seed(100 + acc.process_index)  # each rank's RNG differs, so each needs its own file
    written: list[str] = []
    _record_writes(written)
    folder = acc.save_state(out / "ckpt")
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    first = _epoch(acc, model, optimizer, loader)
    acc.load_state(folder)
    loaded_optimizer = copy.deepcopy(optimizer.state_dict())
    second = _epoch(acc, model, optimizer, loader)
    return {"first": first, "second": second, "written": written, "files": sorted(os.listdir(folder)),
            "optimizer_saved": saved_optimizer, "optimizer_loaded": loaded_optimizer}


def end_training(out: pathlib.Path, extra: list[str]) -> dict[str, Any]:
    """end_training() leaves the process group (runs last: nothing can communicate after it)."""
    acc = Accelerator()
    before = dist.is_initialized()
    acc.end_training()
    return {"before": before, "after": dist.is_initialized()}


SCENARIOS = {"facts": facts, "ddp_runs": ddp_runs, "metrics": metrics, "collectives": collectives,
             "checkpoint": checkpoint, "end_training": end_training}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args, extra = parser.parse_known_args()
    results: dict[str, Any] = {}
    for name in args.scenarios.split(","):
        started = time.perf_counter()
        results[name] = SCENARIOS[name](args.out, extra)
        results[f"{name}_seconds"] = time.perf_counter() - started
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    sys.exit(main())
