"""Peak resident memory of `Trainer.fit` (and the Accelerator loop) against a hand-written loop.

Each loop runs in a fresh Python process, so one run's allocator cache and imports cannot hide
another's. The child reports its peak RSS (VmHWM from /proc/self/status, or ru_maxrss where
there is no /proc) and the RSS it had before training, once torch, the data and the model were
loaded. The model is an MLP of about 32 MB of float32 weights trained with Adam, so weights,
gradients and optimizer state come to roughly 130 MB; the import of torch is in every process
alike. Runs alternate (H A B H A B ...), and the table shows medians.

Target: peak RSS of `Trainer.fit` ≤ 1.05 × the hand loop's + 50 MB.

Usage:
    python -m benchmarks.memory                 # a minute or two
    python -m benchmarks.memory --quick
    python -m benchmarks.memory --smoke         # a tiny MLP: checks that it runs, measures nothing
    python benchmarks/memory.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Callable, Sequence

if not __package__:  # run as a script: make the checkout importable even when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = (1024, 2048, 2048, 1024)  # ~8.4M parameters: ~32 MB of weights
SMOKE_SIZES = (16, 32, 32, 16)  # --smoke: the same loops, a model too small for its memory to show
NUM_SAMPLES, BATCH_SIZE = 512, 32
LOGGER_EVERY, CHECKPOINT_EVERY = 5, 10
TARGET_RATIO, TARGET_SLACK_MB = 1.05, 50.0


# --------------------------------------------------------------------------- measuring a process
def _status_kb(field: str) -> float | None:
    """A `VmXXX:` field of /proc/self/status in kB, or None where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_mb() -> float:
    """Resident memory now, in MB (falls back to the peak where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else peak_rss_mb()


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB on Linux


# --------------------------------------------------------------------------- the child's work
def _workload(sizes: Sequence[int]) -> tuple[Any, Any, Any]:
    """The model class (an MLP of layer widths `sizes`), a DataLoader and the number of steps: the same in
    every child."""
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain import TrainModule

    class WideMLP(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for a, b in zip(sizes, sizes[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, sizes[0], generator=generator)
    y = torch.randn(NUM_SAMPLES, sizes[-1], generator=generator)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    # Past an epoch boundary and two checkpoints; the peak is reached at the first step (Adam state).
    return WideMLP, loader, len(loader) + len(loader) // 2


def _hand(model_cls: Any, loader: Any, steps: int, project: str) -> None:
    from torch.nn import functional as F

    model = model_cls()
    optimizer = model.configure_optimizers()
    done = 0
    while done < steps:
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break


def _accelerator(model_cls: Any, loader: Any, steps: int, project: str) -> None:
    from torch.nn import functional as F

    from fittrain import Accelerator

    accelerator = Accelerator(cpu=True)
    model = model_cls()
    model, optimizer, loader = accelerator.prepare(model, model.configure_optimizers(), loader)
    done = 0
    while done < steps:
        for x, y in loader:
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break


def _trainer(model_cls: Any, loader: Any, steps: int, project: str) -> None:
    from fittrain import Trainer

    Trainer(max_steps=steps, project_dir=project).fit(model_cls(), loader)


def _trainer_callbacks(model_cls: Any, loader: Any, steps: int, project: str) -> None:
    from fittrain import Trainer
    from fittrain.callbacks import Checkpointer, Logger

    callbacks = [Logger(every_n_steps=LOGGER_EVERY), Checkpointer(every_n_steps=CHECKPOINT_EVERY)]
    Trainer(callbacks=callbacks, max_steps=steps, project_dir=project).fit(model_cls(), loader)


LOOPS: dict[str, tuple[str, Callable[..., None]]] = {
    "hand": ("hand-written loop (baseline)", _hand),
    "accelerator": ("fittrain Accelerator loop", _accelerator),
    "trainer": ("fittrain Trainer.fit, no callbacks", _trainer),
    "trainer_callbacks": (f"Trainer.fit + Logger({LOGGER_EVERY}) + Checkpointer({CHECKPOINT_EVERY})",
                          _trainer_callbacks),
}


def child(kind: str, sizes: Sequence[int]) -> dict[str, float]:
    """Runs one loop of an MLP of widths `sizes` in this (fresh) process and returns its memory figures in MB."""
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # measure host memory: keep the Trainer on the CPU
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    model_cls, loader, steps = _workload(sizes)
    before = current_rss_mb()
    project = tempfile.mkdtemp(prefix="fittrain-mem-")
    try:
        LOOPS[kind][1](model_cls, loader, steps, project)
    finally:
        shutil.rmtree(project, ignore_errors=True)
    return {"before_mb": before, "peak_mb": peak_rss_mb(), "steps": steps}


# --------------------------------------------------------------------------- the parent
def run_child(kind: str, smoke: bool) -> dict[str, float]:
    """Starts a fresh interpreter for one loop and reads its JSON report."""
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, *(["--smoke"] if smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"The {kind!r} child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def available(kinds: Sequence[str]) -> tuple[list[str], list[str]]:
    """The loops that can run here (the callbacks may be missing in a partial checkout)."""
    chosen, notes = [], []
    for kind in kinds:
        if kind == "trainer_callbacks":
            try:
                from fittrain.callbacks import Checkpointer, Logger  # noqa: F401
            except ImportError as exc:
                notes.append(f"skipped {LOOPS[kind][0]!r}: {exc}")
                continue
        chosen.append(kind)
    return chosen, notes


def measure(kinds: Sequence[str], repeats: int, smoke: bool = False) -> dict[str, list[dict[str, float]]]:
    """Alternates hand, A, B, ... for `repeats` rounds, each in a fresh process."""
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for round_index in range(repeats):
        for kind in kinds:
            results[kind].append(run_child(kind, smoke))
        print(f"round {round_index + 1}/{repeats} done", file=sys.stderr, flush=True)
    return results


def format_table(results: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table of median peak RSS against the hand loop's."""
    hand_peak = statistics.median(r["peak_mb"] for r in results["hand"])
    limit = TARGET_RATIO * hand_peak + TARGET_SLACK_MB
    lines = ["| loop | peak RSS MB | before training MB | peak − before MB | × hand | vs limit |",
             "|---|---:|---:|---:|---:|---|"]
    for kind, runs in results.items():
        peak = statistics.median(r["peak_mb"] for r in runs)
        before = statistics.median(r["before_mb"] for r in runs)
        verdict = "" if kind == "hand" else ("✅" if peak <= limit else "❌") + f" (limit {limit:.0f} MB)"
        lines.append(f"| {LOOPS[kind][0]} | {peak:.0f} | {before:.0f} | {peak - before:.0f} | "
                     f"{peak / hand_peak:.3f}× | {verdict} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--smoke", action="store_true",
                        help=f"one round of an MLP {'→'.join(map(str, SMOKE_SIZES))}: checks that every loop runs")
    parser.add_argument("--child", choices=sorted(LOOPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.repeats = 1
    if args.repeats < 1:
        parser.error(f"--repeats must be positive. Received: repeats={args.repeats}.")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark (or, with --child, one loop) and prints its report."""
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, SMOKE_SIZES if args.smoke else SIZES)))
        return ""
    kinds, notes = available(list(LOOPS))
    results = measure(kinds, args.repeats, args.smoke)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    lines = [f"Peak RSS, MLP {'→'.join(map(str, sizes))} ({params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MB "
             f"of weights), Adam, CPU, {results['hand'][0]['steps']:.0f} steps, median of {args.repeats} fresh "
             f"processes per loop.", "", format_table(results), "",
             f"Target: ≤{TARGET_RATIO}× the hand loop's peak + {TARGET_SLACK_MB:.0f} MB. 'before training' is the RSS "
             "once torch, the data and the model class are loaded; peak − before is what training added."]
    lines += [f"Note: {note}." for note in notes]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
