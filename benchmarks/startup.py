"""Time to the first steps: `import fittrain` and `Trainer.fit` of 10 steps, against a hand-written loop.

Each run is a fresh Python process (`python -c`), timed from just before the parent starts it
(the interpreter's start) to the end of the last optimizer step, which the child reports with
`time.perf_counter()`, a monotonic clock that every process of the machine shares (CLOCK_MONOTONIC
on Linux, mach_absolute_time on macOS, QueryPerformanceCounter on Windows). The two runs:

- **hand loop**: `import torch`, a tiny MLP (32→64→64→1), SGD with momentum and a DataLoader over a
  TensorDataset, and `--steps` optimizer steps written by hand;
- **fittrain**: the same, plus `import fittrain`, with the model in a `TrainModule` and
  `Trainer(max_steps=...).fit(module, loader)`.

Both pay the same large costs: starting Python, importing torch, and torch's first optimizer,
whose constructor imports torch._dynamo (one to two seconds on a slow CPU). What remains is
fittrain's: importing its modules and the fit's one-time setup (Accelerator, prepare, events).

Runs alternate (hand, fit; fit, hand in the next round), after one unmeasured warm-up run of each
(it fills the bytecode caches and the file cache; see `child_env`). The table shows each run's
medians on two clocks: wall (elapsed time, the target's) and cpu (the process's CPU time, all its
threads), which a busy shared machine disturbs far less. The target: the fit's median within 0.1 s
of the hand loop's. When the fit misses it on either clock (or with `--explain always`), the report
adds where fittrain's own time goes: its imports per module (`python -X importtime`), marking the
modules whose functions a plain fit never calls (candidates for lazy imports), and a cProfile of
the fit in a fresh process, after torch's first optimizer was built (so the torch._dynamo import,
which the hand loop pays too, hides nothing).

Usage:
    python -m benchmarks.startup                     # 7 rounds of 10-step runs, one to two minutes
    python -m benchmarks.startup --rounds 15
    python -m benchmarks.startup --explain always    # and where fittrain's extra time goes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 0.1
TIMEOUT_S = 300
HAND, FIT = "hand loop: import torch, SGD, DataLoader", "import fittrain, Trainer.fit"

# ------------------------------------------------------------------ the child processes' code
_IMPORTS = """\
import time
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
"""
_DATA = """\
imported, imported_cpu = time.perf_counter(), time.process_time()
torch.set_num_threads(1)
torch.manual_seed(0)
_g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn({samples}, 32, generator=_g), torch.randn({samples}, 1, generator=_g)),
                    batch_size=32, shuffle=True)

def layers():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
"""
_HAND_STEPS = """\
def hand(steps):
    model = layers()
    optimizer = sgd(model.parameters())
    done = 0
    while done < steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return done
"""
_MODULE = """\
class Net(fittrain.TrainModule):
    def __init__(self):
        super().__init__()
        self.net = layers()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return sgd(self.parameters())

def fit(steps):
    trainer = fittrain.Trainer(max_steps=steps)
    trainer.fit(Net(), loader)
    return trainer.state.global_step
"""
_PROFILE = """\
import cProfile, os, pstats, sys
sgd([nn.Parameter(torch.zeros(1))])  # torch's first optimizer imports torch._dynamo: both loops pay it
start = time.perf_counter()
hand({steps})
hand_s = time.perf_counter() - start
before = set(sys.modules)
profiler = cProfile.Profile()
start = time.perf_counter()
profiler.enable()
fit({steps})
profiler.disable()
fit_s = time.perf_counter() - start
print(f"After torch's first optimizer: Trainer.fit of {steps} steps {{fit_s * 1e3:.1f}} ms under cProfile, "
      f"the hand loop's {steps} steps {{hand_s * 1e3:.1f}} ms (unprofiled).")
new = sorted({{name if name.startswith("fittrain") else name.split(".")[0] for name in set(sys.modules) - before}})
print(f"Modules first imported during the fit: {{', '.join(new) or 'none'}}.")
stats = pstats.Stats(profiler, stream=sys.stdout)
called = {{os.path.realpath(file) for file, _, function in stats.stats if function != "<module>"}}
print("UNCALLED", *sorted(name for name, module in list(sys.modules.items()) if name.startswith("fittrain.")
                         and os.path.realpath(getattr(module, "__file__", None) or "?") not in called))
stats.sort_stats("cumulative").print_stats(r"fittrain|callbacks", 15)
stats.sort_stats("tottime").print_stats(10)
"""


def child_source(kind: str, steps: int) -> str:
    """The code a child process runs: "hand", "fit" or "profile"; the first two print a RESULT line."""
    data = _DATA.format(samples=steps * 32)  # one epoch is exactly `steps` batches
    if kind == "hand":
        body = _HAND_STEPS + f"done = hand({steps})\n"
    elif kind == "fit":
        body = _MODULE + f"done = fit({steps})\n"
    else:
        return _IMPORTS + "import fittrain\n" + data + _HAND_STEPS + _MODULE + _PROFILE.format(steps=steps)
    imports = _IMPORTS + ("import fittrain\n" if kind == "fit" else "")
    result = "print('RESULT', imported, time.perf_counter(), imported_cpu, time.process_time(), done)\n"
    return imports + data + body + result


def child_env(cwd: str) -> dict[str, str]:
    """Both runs on the CPU with one thread, importing fittrain from this checkout, with bytecode caches.

    An installed package has its bytecode cached (pip compiles it; an editable install caches it at
    its first import). Where PYTHONDONTWRITEBYTECODE forbids writing `__pycache__` folders, the
    children cache it under `cwd` instead (PYTHONPYCACHEPREFIX), and the warm-up run fills it:
    otherwise every run compiles fittrain's sources again (about 50 ms more on a slow CPU).
    """
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(cwd, "pycache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FITTRAIN_STRATEGY"):
        env.pop(name, None)  # a single-process run, even when started under torchrun
    return env


# ------------------------------------------------------------------ timing
@dataclasses.dataclass(frozen=True)
class Timing:
    """One run's seconds from the interpreter's start: imports done, last step done, process exited."""

    imports: float
    steps: float
    exited: float


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (nan where `resource` is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return float("nan")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(args: Sequence[str], cwd: str, timeout: float = TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `python args...` in `cwd`; returns it and its perf_counter start, or raises with its output."""
    start = time.perf_counter()  # the clock the children report in
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(cwd), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"startup: a child process exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return done, start


def timed_run(kind: str, steps: int, cwd: str) -> dict[str, Timing]:
    """One fresh process of `kind` ("hand" or "fit"), on the wall clock and in CPU time (its threads')."""
    cpu_before = _children_cpu()
    done, start = run_child(["-c", child_source(kind, steps)], cwd)
    exited, exited_cpu = time.perf_counter(), _children_cpu() - cpu_before
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"startup: the {kind} run printed no RESULT line:\n{done.stdout[-3000:]}")
    _, imported, finished, imported_cpu, finished_cpu, ran = line.split()
    if int(ran) != steps:
        raise SystemExit(f"startup: the {kind} run made {ran} optimizer steps instead of {steps}.")
    return {"wall": Timing(float(imported) - start, float(finished) - start, exited - start),
            "cpu": Timing(float(imported_cpu), float(finished_cpu), exited_cpu)}


Runs = dict[str, dict[str, list[Timing]]]  # clock ("wall", "cpu") -> run ("hand", "fit") -> one per round


def measure(rounds: int, warmup: int, steps: int, cwd: str, log: Callable[[str], None]) -> Runs:
    """`warmup` unmeasured runs of each, then `rounds` alternating rounds: hand, fit; fit, hand; ..."""
    for _ in range(warmup):
        timed_run("hand", steps, cwd)
        timed_run("fit", steps, cwd)
    runs: Runs = {clock: {"hand": [], "fit": []} for clock in ("wall", "cpu")}
    for index in range(rounds):
        for kind in (("hand", "fit") if index % 2 == 0 else ("fit", "hand")):
            for clock, timing in timed_run(kind, steps, cwd).items():
                runs[clock][kind].append(timing)
        wall = runs["wall"]
        log(f"round {index + 1}/{rounds}: hand {wall['hand'][-1].steps:.2f} s, fit {wall['fit'][-1].steps:.2f} s")
    return runs


# ------------------------------------------------------------------ where the time goes
# What the hand loop imports too (torch, and torch._dynamo through the first optimizer), then fittrain.
_IMPORT_AFTER_HAND = ("import sys, torch; torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1); "
                      "sys.stderr.write('FITTRAIN-IMPORT\\n'); import fittrain")


def _import_costs(stderr: str) -> dict[str, int]:
    """From `python -X importtime -c _IMPORT_AFTER_HAND`: µs per fittrain module.

    A module's cost is its own import time plus that of the other packages' modules first
    imported under it (safetensors under the checkpoint writer, say): what importing it lazily saves.
    """
    lines = stderr.splitlines()
    start = lines.index("FITTRAIN-IMPORT")  # what follows is what fittrain adds to the hand loop's imports
    nodes = [(len(m[2]), m[3], int(m[1])) for line in lines[start + 1:]
             if (m := re.match(r"import time:\s+(\d+) \|\s+\d+ \| (\s*)(\S+)$", line))]
    costs: dict[str, int] = {}
    ancestors: list[tuple[int, str]] = []  # the output is post-order: walk it backwards, parents first
    for depth, name, own in reversed(nodes):
        while ancestors and ancestors[-1][0] >= depth:
            ancestors.pop()
        owner = name if name.startswith("fittrain") else next(
            (a for _, a in reversed(ancestors) if a.startswith("fittrain")), "fittrain")
        costs[owner] = costs.get(owner, 0) + own
        ancestors.append((depth, name))
    return costs


def import_times(cwd: str, repeats: int, uncalled: set[str], top: int = 12) -> str:
    """fittrain's import cost beyond the hand loop's, per module (fastest of `repeats`), and what a fit never calls."""
    best: dict[str, int] = {}
    for _ in range(repeats):
        done, _ = run_child(["-X", "importtime", "-c", _IMPORT_AFTER_HAND], cwd)
        for name, cost in _import_costs(done.stderr).items():
            best[name] = min(best.get(name, cost), cost)
    total, lazy = sum(best.values()), sum(cost for name, cost in best.items() if name in uncalled)
    lines = [f"`import fittrain` after what the hand loop imports (torch, torch._dynamo): {total / 1e3:.1f} ms "
             f"in {len(best)} fittrain modules "
             f"(`-X importtime`, each module's fastest of {repeats}), of which {lazy / 1e3:.1f} ms in modules whose "
             "functions a plain fit never calls (candidates for lazy imports):",
             ", ".join(sorted(name for name in best if name in uncalled)) + ".", "",
             "| module | ms, with the other packages it imports first | called by a plain fit |", "|---|---:|---|"]
    lines += [f"| {name} | {cost / 1e3:.1f} | {'no' if name in uncalled else 'yes'} |"
              for name, cost in sorted(best.items(), key=lambda item: -item[1])[:top]]
    return "\n".join(lines)


def explain(steps: int, cwd: str, repeats: int) -> str:
    """Where fittrain's extra time goes: its imports, and a cProfile of a fit in a fresh process."""
    done, _ = run_child(["-c", child_source("profile", steps)], cwd)
    output = done.stdout.splitlines()
    uncalled = next((set(line.split()[1:]) for line in output if line.startswith("UNCALLED")), set())
    profile = "\n".join(line for line in output if not line.startswith("UNCALLED")).rstrip()
    return "\n".join(["Where fittrain's time goes.", "", import_times(cwd, repeats, uncalled), "",
                      "cProfile of Trainer.fit in a fresh process (cProfile inflates Python calls: read it for "
                      "where the time goes, and the tables above for how much):", profile])


# ------------------------------------------------------------------ report
def describe_machine() -> str:
    """CPU, cores, Python and torch versions, without importing torch in this process."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, " \
           f"torch {importlib.metadata.version('torch')}, one thread"


def _median(timings: list[Timing], field: str) -> float:
    return statistics.median(getattr(t, field) for t in timings)


def difference(runs: dict[str, list[Timing]], field: str = "steps") -> float:
    """The fit's median seconds (to its last step, by default) minus the hand loop's, on one clock."""
    return _median(runs["fit"], field) - _median(runs["hand"], field)


def missed(runs: Runs) -> bool:
    """Whether the fit misses the target on either clock."""
    return any(difference(runs[clock]) > TARGET_S for clock in runs)


def format_table(runs: Runs, steps: int) -> str:
    """A markdown table of each run's medians on each clock, the ratio and the verdict."""
    lines = [f"| run | clock | imports done, s | step {steps} done, s | exited, s | × hand | target |",
             "|---|---|---:|---:|---:|---:|---|"]
    for clock, timings in runs.items():
        hand_steps = _median(timings["hand"], "steps")
        for kind, name in (("hand", HAND), ("fit", FIT)):
            cells = [f"{_median(timings[kind], field):.3f}" for field in ("imports", "steps", "exited")]
            verdict = "" if kind == "hand" else \
                f"≤ hand + {TARGET_S:.2f} s {'✅' if difference(timings) <= TARGET_S else '❌'}"
            lines.append(f"| {name} | {clock} | {' | '.join(cells)} | "
                         f"{_median(timings[kind], 'steps') / hand_steps:.3f}× | {verdict} |")
    return "\n".join(lines)


def summary(runs: Runs, steps: int) -> list[str]:
    """Per clock: the difference of the medians, its split, and the per-round differences."""
    lines = []
    for clock, timings in runs.items():
        diff, imports = difference(timings), difference(timings, "imports")
        pairs = sorted(f.steps - h.steps for h, f in zip(timings["hand"], timings["fit"]))
        # A busy machine only ever adds time: the fastest runs show the cost with the least interference.
        fastest = min(t.steps for t in timings["fit"]) - min(t.steps for t in timings["hand"])
        lines.append(f"{clock}: fittrain − hand loop, to step {steps}: {diff:+.3f} s "
                     f"({'within' if diff <= TARGET_S else 'NOT within'} the {TARGET_S:.1f} s target), of which "
                     f"imports {imports:+.3f} s and setup and steps {diff - imports:+.3f} s (differences of the "
                     f"medians); fastest run against fastest run {fastest:+.3f} s. Per-round differences, "
                     f"sorted: {', '.join(f'{d:+.3f}' for d in pairs)}.")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of one run each (default 7)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each first (default 1)")
    parser.add_argument("--explain", choices=("auto", "always", "never"), default="auto",
                        help="where fittrain's extra time goes: when it misses the target (auto, default), "
                             "always or never")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--rounds and --steps must be at least 1 and --warmup at least 0. Received: "
                     f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}.")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark and prints, and returns, its report."""
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"startup: {args.rounds} rounds of fresh processes, {args.steps} steps each")
    with tempfile.TemporaryDirectory(prefix="fittrain-startup-") as cwd:  # what a Trainer writes goes here
        runs = measure(args.rounds, args.warmup, args.steps, cwd, log)
        lines = [f"Seconds from the interpreter's start, fresh processes, tiny MLP, SGD+momentum, {args.steps} "
                 f"steps, CPU, {args.rounds} alternating rounds; medians. wall: elapsed time; cpu: the process's "
                 "CPU time (all its threads), steadier on a busy machine.", f"Machine: {describe_machine()}.", "",
                 format_table(runs, args.steps), "", *summary(runs, args.steps)]
        if args.explain == "always" or (args.explain == "auto" and missed(runs)):
            lines += ["", explain(args.steps, cwd, repeats=min(args.rounds, 3))]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
