"""Step time and per-rank memory of fittrain's N-D layouts against a hand-written torchtitan-style loop.

One GPT-style model (token embedding, pre-norm attention + MLP blocks, final norm, head; sizes in
`Shape`) trains with AdamW on a next-token cross-entropy loss on 4 gloo processes on the CPU, one
thread each, under five layouts of a (dp_replicate, dp_shard, tp) device mesh: DDP (4, 1, 1),
FSDP2 (1, 4, 1), HSDP (2, 2, 1), TP (1, 1, 4) and FSDP2+TP (1, 2, 2). Every layout gets the same
global batch, dealt to the data-parallel ranks (`rank // tp`), so the ranks of a tp group see the
same sequences. Neither loop clips gradients.

- **hand**: what a PyTorch user writes, torchtitan's way: `init_device_mesh("cpu", (rep, shard, tp),
  mesh_dim_names=("dp_replicate", "dp_shard", "tp"))`; with tp > 1, `parallelize_module` of each
  block over `mesh["tp"]` (q, k, v, up: `ColwiseParallel()`; o, down: `RowwiseParallel()`); with
  sharding (or data parallelism beside tp), `fully_shard(block, mesh=dp_mesh)` for each block, then
  the root, where dp_mesh is `mesh["dp_shard"]`, or `mesh["dp_replicate", "dp_shard"]` with
  replication (HSDP); DDP alone is torch's `DistributedDataParallel`. A `DistributedSampler` by
  data-parallel rank, `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()`.
- **fittrain**: `Accelerator(parallelism_config=ParallelismConfig(...), fsdp_classes=[Block])`,
  `prepare(model, optimizer, loader)` (the model carries a transformers-style `tp_plan` with the
  same styles), `accelerator.backward(loss)`, `optimizer.step()`, `optimizer.zero_grad()`.

How it is timed: one torchrun job runs every layout. Each loop runs once per layout untimed first
(warm-up, 3 steps: DTensor's sharding caches, lazy imports; torch's parallel modules and fittrain
are imported before any run); then, round after round, every layout runs both loops, hand first
in even rounds and fittrain first in odd ones, so drift on a shared machine hits both alike (an
even --rounds balances the orders). A run is one epoch of `--steps` optimizer steps between two
barriers; building the mesh, the model, its parallelization and the loader is outside the clock.
The headline is rank 0's median step time over every timed step of every round (the collectives
keep the ranks in step). Beside it, the lowest and highest ratio of one round's median step times
show how noisy one round is, and, as cross-checks: the median over rounds of whole-epoch time
ratios (rank 0), and of CPU time ratios (the 4 processes' CPU seconds summed: what the loops cost,
whatever the scheduling of 4 processes on fewer cores did to the wall clock).
Target: fittrain at most 1.05x the hand loop in every layout.

Memory, per rank:
- **held**: bytes of the parameters, gradients and AdamW state (moments and step counters) this
  rank holds after the first optimizer step of the warm-up run, before `zero_grad` (the local shard
  of a DTensor: `to_local()`), for each loop; the largest over the ranks.
- **estimate**: `fittrain.distributed.memory_estimate.estimate_memory` for the same model built on
  the meta device and the same layout, "adamw"; shown as its ratio to fittrain's measured bytes.
  Target: within 10% (0.90x to 1.10x) for parameters, gradients and optimizer state in every layout.
- **extra peak RSS**: before each timed run a process collects garbage, hands free heap memory back
  to the OS (`malloc_trim`), resets its RSS high-water mark (`echo 5 > /proc/self/clear_refs`) and
  reads its RSS; after the run, VmHWM minus that RSS is the extra resident memory the run needed
  (model, gradients, optimizer state, activations, communication buffers; whatever of it reuses
  heap memory left over from earlier runs does not show). Median over rounds, largest over ranks.
  Where /proc cannot do this (not Linux) the column says n/a. The footer gives each process's
  `ru_maxrss`, which is its peak over the whole job: every layout and both loops, not either loop.

Usage:
    python -m benchmarks.layouts                          # about 3 minutes on a 2-core machine
    python -m benchmarks.layouts --steps 40 --rounds 8
    python -m benchmarks.layouts --layouts fsdp fsdp_tp --rounds 2
    python -m benchmarks.layouts --smoke                  # a tiny model, 2 steps, 1 round: checks it runs
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import importlib
import json
import os
import pathlib
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

if not __package__:  # run by torchrun as a script: import fittrain from this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fittrain.distributed.teardown import leave_process_group

PROCESSES = 4
LR = 3e-4
LOOPS = ("hand", "fittrain")
#: --layouts name -> (row name, (dp_replicate, dp_shard, tp)).
LAYOUTS: dict[str, tuple[str, tuple[int, int, int]]] = {
    "ddp": ("DDP", (4, 1, 1)),
    "fsdp": ("FSDP2", (1, 4, 1)),
    "hsdp": ("HSDP", (2, 2, 1)),
    "tp": ("TP", (1, 1, 4)),
    "fsdp_tp": ("FSDP2+TP", (1, 2, 2)),
}
WARMUP_STEPS = 3
TARGET_STEP_RATIO, TARGET_ESTIMATE_ERROR = 1.05, 0.10
KINDS = ("parameters", "gradients", "optimizer_state")
MIB = 2**20
# torchrun's variables, which must not leak from an outer launcher into the job's environment.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FITTRAIN_STRATEGY")


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and data sizes. Widths and heads divide by 4, so every layout splits and shards evenly."""

    vocab: int = 512
    width: int = 128
    heads: int = 8
    layers: int = 2
    length: int = 64  # tokens per sequence (the model sees length, predicts the next of each)
    batch: int = 16  # sequences per optimizer step, over all data-parallel ranks


SMOKE = Shape(vocab=64, width=32, heads=4, layers=2, length=16, batch=8)


class Block(nn.Module):
    """Pre-norm attention and MLP. The head count comes from the projections' width (`-1`), as in
    transformers' models, so that a tp rank holding heads / tp of them computes its own."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Embedding, blocks, norm, head; the plan is transformers' convention, which fittrain reads."""

    tp_plan = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.o": "rowwise",
               "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.blocks = nn.ModuleList(Block(shape.width, shape.heads) for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(shape.width), nn.Linear(shape.width, shape.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _make_model(shape: Shape) -> GPT:
    torch.manual_seed(0)
    return GPT(shape)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _dataset(shape: Shape, steps: int) -> TensorDataset:
    """Exactly `steps` global batches: one epoch is `steps` optimizer steps on every rank."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, shape.vocab, (steps * shape.batch, shape.length + 1), generator=g))


# --------------------------------------------------------------------------- what a rank holds
def _local_bytes(tensors: Any) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if t is not None)


def _held(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    parameters = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"parameters": _local_bytes(parameters), "gradients": _local_bytes(p.grad for p in parameters),
            "optimizer_state": _local_bytes(state)}


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> int | None:
    """Frees what can be freed, resets the RSS high-water mark and returns the RSS (kB), or None
    where the high-water mark cannot be reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


# --------------------------------------------------------------------------- the two loops
Measure = Callable[[nn.Module, torch.optim.Optimizer], None]


def _hand_loop(shape: Shape, data: TensorDataset, sizes: tuple[int, int, int],
               measure: Measure | None) -> Iterator[None]:
    """The torchtitan-style loop: yields once when set up, then after every optimizer step."""
    rep, shard, tp = sizes
    dp = rep * shard
    model: nn.Module = _make_model(shape)
    if shard > 1 or tp > 1:
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        if tp > 1:
            for block in model.blocks:
                parallelize_module(block, mesh["tp"], {
                    "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                    "up": ColwiseParallel(), "down": RowwiseParallel()})
        if dp > 1:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if rep > 1 else mesh["dp_shard"]
            for block in model.blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
    elif dp > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sampler = DistributedSampler(data, num_replicas=dp, rank=dist.get_rank() // tp, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=shape.batch // dp, sampler=sampler)
    yield
    for (tokens,) in loader:
        _loss(model, tokens).backward()
        optimizer.step()
        if measure is not None:
            measure(model, optimizer)
            measure = None
        optimizer.zero_grad()
        yield


def _fittrain_loop(shape: Shape, data: TensorDataset, sizes: tuple[int, int, int],
                   measure: Measure | None) -> Iterator[None]:
    """The same training with fittrain's Accelerator, yielding at the same points."""
    from fittrain import Accelerator, ParallelismConfig

    rep, shard, tp = sizes
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=rep, dp_shard_size=shard,
                                                                   tp_size=tp), fsdp_classes=[Block])
    model = _make_model(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(data, batch_size=shape.batch // (rep * shard), shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    yield
    for (tokens,) in loader:
        accelerator.backward(_loss(model, tokens))
        optimizer.step()
        if measure is not None:
            measure(model, optimizer)
            measure = None
        optimizer.zero_grad()
        yield


def _run(loop: str, shape: Shape, data: TensorDataset, sizes: tuple[int, int, int],
         measure: Measure | None = None) -> dict[str, Any]:
    """One epoch, barrier to barrier: its wall and CPU seconds, each step's wall seconds and the
    extra peak RSS (kB; None where it cannot be measured)."""
    base = _reset_peak()
    runner = (_hand_loop if loop == "hand" else _fittrain_loop)(shape, data, sizes, measure)
    next(runner)  # setup, off the clock
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    ticks = [wall]
    for _ in runner:
        ticks.append(time.perf_counter())
    dist.barrier()
    result = {"run": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
              "steps": [b - a for a, b in zip(ticks, ticks[1:])]}
    peak = _status_kb("VmHWM")
    result["peak_kb"] = None if base is None or peak is None else peak - base
    runner.close()  # drops the model, optimizer and (fittrain) Accelerator before the next run
    return result


def _estimates(shape: Shape, layouts: list[str]) -> dict[str, dict[str, int]]:
    from fittrain import ParallelismConfig
    from fittrain.distributed.memory_estimate import estimate_memory

    with torch.device("meta"):
        model = GPT(shape)
    estimates = {}
    for name in layouts:
        rep, shard, tp = LAYOUTS[name][1]
        estimate = estimate_memory(model, ParallelismConfig(dp_replicate_size=rep, dp_shard_size=shard, tp_size=tp),
                                   "adamw")
        estimates[name] = {kind: getattr(estimate, kind) for kind in KINDS}
    return estimates


def _worker(args: argparse.Namespace) -> None:
    # Imported before the group, torch._dynamo (which DDP imports) holds no reference to it, and the
    # teardown below can end gloo's threads before the interpreter does (fittrain.distributed.teardown
    # says why: otherwise a finished rank can die with SIGABRT at exit on a busy machine).
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    if dist.get_world_size() != PROCESSES:
        raise RuntimeError(f"benchmarks.layouts needs {PROCESSES} processes. Received: {dist.get_world_size()}.")

    shape = _shape(args)
    data, warmup = _dataset(shape, args.steps), _dataset(shape, min(args.steps, WARMUP_STEPS))
    result: dict[str, Any] = {"held": {}, "runs": {}}
    for name in args.layouts:
        sizes = LAYOUTS[name][1]
        for loop in LOOPS:
            def measure(model: nn.Module, optimizer: torch.optim.Optimizer, key: str = f"{name}/{loop}") -> None:
                result["held"][key] = _held(model, optimizer)

            _run(loop, shape, warmup, sizes, measure)  # warm-up, untimed
            result["runs"][f"{name}/{loop}"] = []
    for round_index in range(args.rounds):
        for name in args.layouts:
            for loop in LOOPS if round_index % 2 == 0 else reversed(LOOPS):
                result["runs"][f"{name}/{loop}"].append(_run(loop, shape, data, LAYOUTS[name][1]))
    if dist.get_rank() == 0:
        result["estimates"] = _estimates(shape, args.layouts)
    result["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pathlib.Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    leave_process_group()


# --------------------------------------------------------------------------- the parent
def _shape(args: argparse.Namespace) -> Shape:
    base = SMOKE if args.smoke else Shape()
    return dataclasses.replace(base, **{k: getattr(args, k) for k in ("width", "layers", "length", "batch")
                                        if getattr(args, k) is not None})


def _worker_args(args: argparse.Namespace) -> list[str]:
    forwarded = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--timeout", str(args.timeout),
                 "--layouts", *args.layouts]
    for key in ("width", "layers", "length", "batch"):
        if getattr(args, key) is not None:
            forwarded += [f"--{key}", str(getattr(args, key))]
    return forwarded + (["--smoke"] if args.smoke else [])


def _launch(args: argparse.Namespace, out: pathlib.Path) -> list[dict[str, Any]]:
    """Runs the torchrun job; returns each rank's result. Exits non-zero with the job's output when
    it fails or overruns --timeout (then it is killed, with every worker)."""
    # --standalone: torchrun binds a free port itself; one picked here first could be taken meanwhile.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(PROCESSES),
               os.path.abspath(__file__), "--worker", "--out", str(out), *_worker_args(args)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        sys.stderr.write(output[-8000:])
        sys.exit(f"benchmarks.layouts: the job was still running after {args.timeout:.0f} s; killed it. "
                 "Pass a larger --timeout on a slow machine.")
    finally:
        if proc.poll() is None:  # interrupted: leave no worker behind
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        sys.stderr.write(output[-8000:])
        sys.exit(f"benchmarks.layouts: the job exited with {proc.returncode} (its output is above).")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


def _cpu(ranks: list[dict[str, Any]], name: str, loop: str) -> list[float]:
    """The CPU seconds of each round's run of `loop`, summed over the ranks."""
    return [sum(run) for run in zip(*([run["cpu"] for run in r["runs"][f"{name}/{loop}"]] for r in ranks))]


def _summary(ranks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    runs = {loop: ranks[0]["runs"][f"{name}/{loop}"] for loop in LOOPS}
    pairs = list(zip(runs["fittrain"], runs["hand"]))
    step_ms = {loop: statistics.median(t for run in runs[loop] for t in run["steps"]) * 1e3 for loop in LOOPS}
    rounds = [statistics.median(f["steps"]) / statistics.median(h["steps"]) for f, h in pairs]
    held = {loop: {kind: max(r["held"][f"{name}/{loop}"][kind] for r in ranks) for kind in KINDS} for loop in LOOPS}
    peaks: dict[str, float | None] = {}
    for loop in LOOPS:
        per_rank = [[run["peak_kb"] for run in r["runs"][f"{name}/{loop}"]] for r in ranks]
        known = [statistics.median(p) for p in per_rank if p and None not in p]
        peaks[loop] = max(known) / 1024 if len(known) == len(ranks) else None
    estimate = ranks[0]["estimates"][name]
    return {"step_ms": step_ms, "ratio": step_ms["fittrain"] / step_ms["hand"], "rounds": (min(rounds), max(rounds)),
            "run_ratio": statistics.median(f["run"] / h["run"] for f, h in pairs),
            "cpu_ratio": statistics.median(f / h for f, h in zip(*(_cpu(ranks, name, loop) for loop in LOOPS[::-1]))),
            "held": held, "peak_mib": peaks,
            "estimate": {kind: estimate[kind] / held["fittrain"][kind] if held["fittrain"][kind] else float("nan")
                         for kind in KINDS}}


def _mib(held: dict[str, int]) -> str:
    return " / ".join(f"{held[kind] / MIB:.3f}" for kind in KINDS)


def _ratios(ratios: dict[str, float]) -> str:
    return " / ".join(f"{ratios[kind]:.3f}×" for kind in KINDS)


def _peak(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _row(name: str, s: dict[str, Any]) -> str:
    cells = [LAYOUTS[name][0], str(LAYOUTS[name][1]), f"{s['step_ms']['hand']:.2f}", f"{s['step_ms']['fittrain']:.2f}",
             f"{s['ratio']:.3f}×", f"{s['rounds'][0]:.3f}–{s['rounds'][1]:.3f}", f"{s['run_ratio']:.3f}×",
             f"{s['cpu_ratio']:.3f}×", _mib(s["held"]["hand"]), _mib(s["held"]["fittrain"]), _ratios(s["estimate"]),
             f"{_peak(s['peak_mib']['hand'])} / {_peak(s['peak_mib']['fittrain'])}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("layout", "mesh (rep, shard, tp)", "hand ms/step", "fittrain ms/step", "ratio", "rounds' ratios", "run ratio",
          "CPU ratio", "held MiB hand: param / grad / optim", "held MiB fittrain", "estimate / fittrain's held",
          "extra peak RSS MiB hand / fittrain")


def _table(ranks: list[dict[str, Any]], args: argparse.Namespace) -> str:
    shape = _shape(args)
    parameters = sum(p.numel() for p in GPT(shape).parameters())
    summaries = {name: _summary(ranks, name) for name in args.layouts}
    worst_name = max(summaries, key=lambda n: summaries[n]["ratio"])
    worst = summaries[worst_name]["ratio"]
    errors = {(n, kind): abs(s["estimate"][kind] - 1) for n, s in summaries.items() for kind in KINDS}
    worst_error = max(errors, key=lambda k: errors[k])
    worst_estimate = summaries[worst_error[0]]["estimate"][worst_error[1]]
    step_verdict = "within" if worst <= TARGET_STEP_RATIO else "OVER"
    estimate_verdict = "within" if all(e <= TARGET_ESTIMATE_ERROR for e in errors.values()) else "OUTSIDE"
    maxrss = ", ".join(f"{r['maxrss_kb'] / 1024:.0f}" for r in ranks)
    return "\n".join([
        f"{PROCESSES} processes (gloo, CPU, 1 thread each), torch {torch.__version__}; GPT: vocab {shape.vocab}, "
        f"width {shape.width}, {shape.heads} heads, {shape.layers} blocks, {parameters / 1e6:.2f}M parameters; "
        f"AdamW, no clipping; global batch {shape.batch} × {shape.length} tokens; {args.steps} steps/run, "
        f"{args.rounds} rounds, loops alternating",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|---|---|" + "---:|" * (len(HEADER) - 2),
        *(_row(name, summaries[name]) for name in args.layouts),
        "",
        f"ms/step: rank 0's median over every timed step; ratio: fittrain / hand of those (target ≤ "
        f"{TARGET_STEP_RATIO}×); rounds' ratios: the lowest and highest of that ratio within one round (the noise "
        "of one round); run ratio: median over rounds of whole-epoch time ratios; CPU ratio: the same for the "
        "processes' summed CPU time.",
        "held: parameters / gradients / AdamW state (moments, step counters) after the first step, local shards, "
        "the largest rank; estimate: estimate_memory(meta model, layout, 'adamw') over fittrain's held bytes, "
        f"param / grad / optim (target within {TARGET_ESTIMATE_ERROR:.0%}).",
        "extra peak RSS: VmHWM over the RSS just before the run (high-water mark reset, heap trimmed), median over "
        "rounds, the largest rank.",
        f"ru_maxrss per rank over the whole job (every layout, both loops, not one loop's): {maxrss} MiB.",
        f"Verdict: step time {step_verdict} the {TARGET_STEP_RATIO}× target (worst {worst:.3f}×, "
        f"{LAYOUTS[worst_name][0]}); estimates {estimate_verdict} {TARGET_ESTIMATE_ERROR:.0%} of measured "
        f"(furthest: {worst_estimate:.3f}×, {LAYOUTS[worst_error[0]][0]} {worst_error[1].replace('_', ' ')}).",
    ])


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark (or, with --worker, one process of it) and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per timed run (default 20; --smoke 2)")
    parser.add_argument("--rounds", type=int, default=None, help="timed runs of each loop per layout (default 6; "
                                                                  "--smoke 1)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="layouts to run")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps, 1 round: checks that it runs")
    parser.add_argument("--width", type=int, help="model width (a multiple of 4 × heads)")
    parser.add_argument("--layers", type=int, help="blocks")
    parser.add_argument("--length", type=int, help="tokens per sequence")
    parser.add_argument("--batch", type=int, help="global batch, in sequences (a multiple of 4)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the job is killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.smoke else 20)
    args.rounds = args.rounds or (1 if args.smoke else 6)
    args.layouts = list(dict.fromkeys(args.layouts))
    shape = _shape(args)
    if shape.batch % PROCESSES or shape.width % (shape.heads * PROCESSES):
        parser.error(f"--batch must be a multiple of {PROCESSES} and --width of {shape.heads * PROCESSES}. "
                     f"Received: --batch {shape.batch} --width {shape.width}.")
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="fittrain-layouts-bench-") as folder:
        print(_table(_launch(args, pathlib.Path(folder)), args))


if __name__ == "__main__":
    main()
