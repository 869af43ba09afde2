"""torch.compile on the CPU: `Trainer(compile=True)` against the eager Trainer and a hand-written loop.

A small transformer stack (GPT-style pre-norm blocks, or `nn.TransformerEncoderLayer` with
`--block encoder`, and a linear head, MSE loss on random targets) trains with AdamW in four loops,
on the same data from the same initial weights:

- **hand, eager**: a plain PyTorch loop;
- **hand, compiled**: the same loop with `model.forward = torch.compile(model.forward)`;
- **Trainer, eager**: `Trainer.fit` without callbacks;
- **Trainer, compiled**: `Trainer(compile=True)` (or the options given with `--backend`/`--mode`).

What is timed: `training_step` ticks a clock each time it starts (the hand loops call it too), so
the intervals between ticks are whole steps: forward, backward, optimizer step and the loop's own
code. The first `--warmup` steps of each run are left out (they include compiling); the table
reports each loop's median step over the rest, the median over alternating rounds (contender
order rotated each round, so a busy machine slows each loop alike). The compiled loops' first
step, compile included, is reported apart. Dynamo's caches are reset before each compiled run,
so every run compiles; inductor's on-disk cache (under /tmp/torchinductor_<user>) makes the later
compiles, and those of a second invocation, faster: the first compiled run of the first
invocation shows the cold compile time.

Usage:
    python -m benchmarks.compile                 # defaults: a few minutes on a slow 2-core VM
    python -m benchmarks.compile --smoke         # tiny sizes, backend "eager": seconds
    python -m benchmarks.compile --layers 2 --d-model 128 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

if not __package__:  # run as a script: make the checkout importable even when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch._dynamo  # only this benchmark pays the import: it compiles anyway
from torch import nn

from fittrain import Trainer, TrainModule

LOOPS = ("hand, eager", "hand, compiled", "Trainer, eager", "Trainer, compiled")


class Block(nn.Module):
    """A pre-norm transformer block written out (attention as matmul + softmax, a GELU MLP), as
    GPT-style models write theirs: the operations inductor fuses on the CPU."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = ((q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Stack(TrainModule):
    """Transformer blocks and a linear head; `ticks` collects the start time of every step.

    `block="gpt"` (the default) stacks `Block`s; `block="encoder"` stacks torch's
    `nn.TransformerEncoderLayer`, whose fused attention inductor decomposes on the CPU, so that it
    runs slower compiled than eager there (measured 1.6x with torch 2.13).
    """

    def __init__(self, d_model: int, layers: int, heads: int, block: str = "gpt") -> None:
        super().__init__()
        if block == "encoder":
            layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, batch_first=True)
            self.encoder: nn.Module = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        else:
            self.encoder = nn.Sequential(*[Block(d_model, heads) for _ in range(layers)])
        self.head = nn.Linear(d_model, 1)
        self.ticks: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any) -> torch.Tensor:
        self.ticks.append(time.perf_counter())
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    steps = args.warmup + args.steps
    return [(torch.randn(args.batch, args.seq, args.d_model, generator=g),
             torch.randn(args.batch, args.seq, 1, generator=g)) for _ in range(steps)]


def new_module(args: argparse.Namespace) -> Stack:
    torch.manual_seed(0)
    return Stack(args.d_model, args.layers, args.heads, args.block)


def hand(module: Stack, batches: list[Any], options: dict[str, Any] | None) -> None:
    if options is not None:
        module.forward = torch.compile(module.forward, **options)
    optimizer = module.configure_optimizers()
    module.train()
    for batch in batches:
        loss = module.training_step(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def trainer(module: Stack, batches: list[Any], options: dict[str, Any] | None, project: str) -> None:
    fit = Trainer(compile=options if options is not None else False, max_epochs=1, project_dir=project,
                  preemption_signals=())
    fit.fit(module, batches)


def run_once(loop: str, args: argparse.Namespace, batches: list[Any], project: str) -> tuple[float, float]:
    """One run of `loop`: (median step after warm-up, first step) in seconds."""
    module = new_module(args)
    options = compile_options(args) if "compiled" in loop else None
    if options is not None:
        torch._dynamo.reset()  # or this run would reuse the graphs of the last compiled run: every run compiles
    if loop.startswith("hand"):
        hand(module, batches, options)
    else:
        trainer(module, batches, options, project)
    steps = [b - a for a, b in zip(module.ticks, module.ticks[1:])]
    return statistics.median(steps[args.warmup:] or steps), steps[0]


def compile_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"backend": args.backend}
    if args.mode:
        options["mode"] = args.mode
    return options


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, dict[str, list[float]]]:
    batches = make_batches(args)
    runs: dict[str, dict[str, list[float]]] = {loop: {"step": [], "first": []} for loop in LOOPS}
    with tempfile.TemporaryDirectory(prefix="fittrain-compile-") as project:
        for round_index in range(args.rounds):
            order = LOOPS[round_index % len(LOOPS):] + LOOPS[:round_index % len(LOOPS)]
            for loop in order:
                step, first = run_once(loop, args, batches, project)
                runs[loop]["step"].append(step)
                runs[loop]["first"].append(first)
                log(f"round {round_index + 1}/{args.rounds} {loop}: {step * 1e3:.2f} ms/step, first step "
                    f"{first:.2f} s")
    return runs


def describe_machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s), Python {platform.python_version()}")


def format_table(runs: dict[str, dict[str, list[float]]]) -> str:
    step = {loop: statistics.median(runs[loop]["step"]) for loop in LOOPS}
    against = {"hand, eager": "hand, eager", "hand, compiled": "hand, eager", "Trainer, eager": "hand, eager",
               "Trainer, compiled": "Trainer, eager"}
    rows = ["| loop | ms/step | ratio | against | first step, s (compile included) |", "|---|---|---|---|---|"]
    for loop in LOOPS:
        first = f"{runs[loop]['first'][0]:.2f} (later runs {statistics.median(runs[loop]['first'][1:]):.2f})" \
            if len(runs[loop]["first"]) > 1 else f"{runs[loop]['first'][0]:.2f}"
        rows.append(f"| {loop} | {step[loop] * 1e3:.2f} | {step[loop] / step[against[loop]]:.3f}× | "
                    f"{against[loop]} | {first} |")
    overhead = step["Trainer, compiled"] / step["hand, compiled"]
    rows.append(f"| Trainer, compiled | {step['Trainer, compiled'] * 1e3:.2f} | {overhead:.3f}× | hand, compiled | "
                "fittrain's own overhead under compile |")
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", choices=("gpt", "encoder"), default="gpt",
                        help="gpt: a written-out pre-norm block (default); encoder: nn.TransformerEncoderLayer")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run, after warm-up (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run, compile included (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: torch's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier when shared)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, backend eager, one round: checks that the benchmark runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq, args.batch = 1, 16, 2, 8, 4
        args.steps, args.warmup, args.rounds, args.backend = 3, 1, 1, "eager"
    if min(args.layers, args.d_model, args.heads, args.seq, args.batch, args.steps, args.rounds) < 1 or args.warmup < 1:
        parser.error("every size, --steps and --rounds must be at least 1, and --warmup at least 1 (the first step "
                     "compiles).")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark and prints, and returns, its report."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    runs = measure(args, log)
    options = compile_options(args)
    kind = "GPT-style Block" if args.block == "gpt" else "TransformerEncoderLayer"
    lines = [f"Transformer stack on the CPU: {args.layers} x {kind}(d_model={args.d_model}, "
             f"heads={args.heads}), seq {args.seq}, batch {args.batch}, AdamW; torch.compile({options}); "
             f"median step of {args.steps} after {args.warmup} warm-up steps, median of {args.rounds} "
             "alternating rounds.", f"Machine: {describe_machine()}.", "", format_table(runs)]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
