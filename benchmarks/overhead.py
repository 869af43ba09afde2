"""Per-step overhead of fittrain's loops against a hand-written PyTorch loop.

The model is a tiny MLP on the CPU with one thread, so a step costs well under a millisecond and
any Python a framework adds per step shows in the ratio. Every loop trains the same model (same
initial weights) on the same data for the same number of optimizer steps, in these batch modes:

- **DataLoader**: a real `DataLoader` over a `TensorDataset` builds each batch (index + collate).
- **pre-built**: batches are collated once, before timing, and every loop iterates the same
  Python list of them: the hand loop and the Accelerator loop directly (nothing is prepared),
  `Trainer.fit` and Lightning through their support for a plain list of batches, Ignite through
  its support for any iterable.
- **batch_size=None** and **IterableDataset** (`benchmarks/loaders.py`; only the hand, Accelerator
  and `Trainer.fit` rows): a real DataLoader over the pre-built batches as a map-style dataset,
  and one batching a stream of the samples; the hand loop iterates it unprepared, the others
  prepared. `--workers-row` measures instead samples/s over a stream with `num_workers=2`.

What is timed: every loop's batch source ticks a clock when it hands out a batch (the collate
function or the list iterator: the same code in every loop), so the intervals
between ticks are whole steps in steady state. They include epoch boundaries and the callbacks'
periodic work (a Logger write every 50 steps, a checkpoint every 500, hence the default of 501
steps) and exclude one-off setup and teardown (prepare, opening TensorBoard, closing files),
which the table reports apart as the fixed cost per run.

Runs alternate with the hand loop (H A H B H C ... H, contender order rotated each round). A
shared machine only ever adds time, and it adds it at random steps, while every run of a loop
repeats the same steps. So for each step position the table takes the fastest of the runs and
averages those: interference goes, the work a step really does stays. The ratio divides that by
the same statistic of the hand runs taken just before each run. The plain median ratio to the
hand runs around each run is shown beside it; on an idle machine the two agree.

The workload (model, data, clock) is in `benchmarks/workload.py`, the timed loops in
`benchmarks/overhead_loops.py`; this module alternates them and writes the table.

Usage:
    python -m benchmarks.overhead                  # defaults: about three minutes on a slow 2-core VM
    python -m benchmarks.overhead --quick          # a smoke run
    python benchmarks/overhead.py --steps 1001 --repeats 15
    python -m benchmarks.overhead --profile "no callbacks" --mode prebuilt   # cProfile one loop
    python -m benchmarks.overhead --modes batched,stream     # only the rows of these batch modes
    python -m benchmarks.overhead --workers-row              # samples/s with num_workers=2 instead
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time
import warnings
from typing import Callable, Sequence

if not __package__:  # run as a script: make the checkout importable even when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmark is about CPU overhead; keep the Trainer (which picks a GPU when it sees one) on
# the CPU too. CUDA reads this lazily, at its first use, so setting it here is early enough.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch

from benchmarks import loaders
from benchmarks.overhead_loops import (
    run_accelerator,
    run_fittrain_lightning,
    run_fittrain_lightning_self_log,
    run_hand,
    run_hf_accelerate,
    run_ignite,
    run_lightning,
    run_lightning_self_log,
    run_trainer,
    run_trainer_default_bar,
    run_trainer_logger,
    run_trainer_logger_ckpt,
    run_trainer_self_log,
    run_trainer_trackers_best,
)
from benchmarks.workload import (
    BATCH_SIZE,
    CHECKPOINT_EVERY,
    HIDDEN,
    IN_FEATURES,
    LOGGER_EVERY,
    OUT_FEATURES,
    RunResult,
    Workload,
    make_workload,
    quiet_per_step,
)


# --------------------------------------------------------------------------- which rows run
@dataclasses.dataclass(frozen=True)
class Contender:
    """One loop: its runner, the modes it runs in, its target ratios and what it needs to import."""

    name: str
    run: Callable[[Workload, str], RunResult]
    modes: tuple[str, ...] = ("loader", "prebuilt")
    target: dict[str, float] = dataclasses.field(default_factory=dict)
    needs: tuple[str, ...] = ()  # "module" or "module:Name"; "a|b" means either


MODES = ("loader", "prebuilt", "batched", "stream")  # the last two: benchmarks/loaders.py
AA_CONTROL = "hand loop again (A/A control)"
AA_TOLERANCE = 0.02
MODE_TITLES = {"loader": "DataLoader", "prebuilt": "pre-built", "batched": "batch_size=None",
               "stream": "IterableDataset"}

CONTENDERS = (
    # The hand loop against itself: its ratio is this run's measurement error. When it strays from
    # 1.000× by more than a target's margin, the machine is too busy to judge that target.
    Contender(AA_CONTROL, run_hand, modes=MODES),
    Contender("fittrain Accelerator loop", run_accelerator, modes=MODES,
              target={"prebuilt": 1.03, "batched": 1.03, "stream": 1.03}),
    Contender("fittrain Trainer.fit, no callbacks", run_trainer, modes=MODES,
              target={"loader": 1.05, "prebuilt": 1.05, "batched": 1.05, "stream": 1.05}),
    Contender("Trainer.fit, default progress bar", run_trainer_default_bar, target={"loader": 1.05, "prebuilt": 1.05}),
    Contender("Trainer.fit, self.log x3 (step+epoch, prog_bar), default bar", run_trainer_self_log,
              target={"loader": 1.10, "prebuilt": 1.10}),
    Contender(f"Trainer.fit + Logger({LOGGER_EVERY})", run_trainer_logger,
              target={"loader": 1.10, "prebuilt": 1.10}, needs=("fittrain.callbacks:Logger",)),
    Contender(f"Trainer.fit + Logger({LOGGER_EVERY}) + Checkpointer({CHECKPOINT_EVERY})", run_trainer_logger_ckpt,
              needs=("fittrain.callbacks:Logger", "fittrain.callbacks:Checkpointer")),
    Contender(f"Trainer.fit + Logger({LOGGER_EVERY}, TensorBoard+CSV) + best Checkpointer({CHECKPOINT_EVERY})",
              run_trainer_trackers_best, target={"loader": 1.10, "prebuilt": 1.10},
              needs=("fittrain.callbacks:Logger", "fittrain.callbacks:Checkpointer")),
    Contender("HF Accelerate loop", run_hf_accelerate, needs=("accelerate",)),
    Contender("Lightning Trainer", run_lightning, needs=("lightning|pytorch_lightning",)),
    Contender("fittrain.lightning Trainer (the same program)", run_fittrain_lightning, target={"prebuilt": 1.05}),
    Contender("Lightning Trainer, self.log x3", run_lightning_self_log, needs=("lightning|pytorch_lightning",)),
    Contender("fittrain.lightning Trainer, self.log x3", run_fittrain_lightning_self_log,
              target={"prebuilt": 1.10}),
    Contender("Ignite supervised trainer", run_ignite, needs=("ignite",)),
)


def _importable(spec: str) -> bool:
    """Whether any alternative of `a|b` imports; `module:Name` also needs the module to define Name."""
    for alternative in spec.split("|"):
        module, _, attr = alternative.partition(":")
        try:
            imported = __import__(module, fromlist=["_"])
        except Exception:  # not installed, or broken mid-edit: either way the row cannot run
            continue
        if not attr or hasattr(imported, attr):
            return True
    return False


def available(contenders: Sequence[Contender], only: str | None) -> tuple[list[Contender], list[str]]:
    """The contenders that can run here, and a note for each one skipped."""
    chosen, notes = [], []
    for contender in contenders:
        if only and only.lower() not in contender.name.lower() and contender.name != AA_CONTROL:
            continue
        missing = [spec for spec in contender.needs if not _importable(spec)]
        if missing:
            notes.append(f"skipped {contender.name!r}: {', '.join(missing)} not importable here")
        else:
            chosen.append(contender)
    return chosen, notes


# --------------------------------------------------------------------------- timing
@dataclasses.dataclass
class Samples:
    """One loop's runs in one mode, with the hand runs just before them and each run's ratio."""

    runs: list[RunResult] = dataclasses.field(default_factory=list)
    # As many hand runs as own runs, taken just before each: a minimum over more runs would
    # flatter the hand loop, and neighbours in time share the machine's mood.
    hand_before: list[RunResult] = dataclasses.field(default_factory=list)
    ratios: list[float] = dataclasses.field(default_factory=list)

    @property
    def quiet(self) -> float:
        return quiet_per_step(self.runs)

    @property
    def quiet_ratio(self) -> float:
        return self.quiet / quiet_per_step(self.hand_before)

    @property
    def fixed(self) -> float:
        return statistics.median(r.fixed for r in self.runs)


def _timed(run: Callable[[Workload, str], RunResult], work: Workload, mode: str) -> RunResult:
    gc.collect()  # start every run with the same garbage, so collection pauses fall alike
    return run(work, mode)


@dataclasses.dataclass
class Measurement:
    """Everything one benchmark run timed."""

    # The first hand run of each round: as many as each contender has, for the baseline row.
    hand_first: dict[str, list[RunResult]]
    hand_all: dict[str, list[RunResult]]  # for the noise line
    results: dict[tuple[str, str], Samples]
    # (loop, mode) -> the error its warm-up run raised: the table reports it instead of a time.
    failures: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)


def measure(work: Workload, contenders: Sequence[Contender], repeats: int, log: Callable[[str], None],
            modes: Sequence[str] = MODES, failures: dict[tuple[str, str], str] | None = None) -> Measurement:
    """Runs H C1 H C2 ... H per mode and round, rotating the contender order every round; loops in
    `failures` are left out."""
    out = Measurement({mode: [] for mode in modes}, {mode: [] for mode in modes}, {}, dict(failures or {}))
    for round_index in range(repeats):
        for mode in modes:
            group = [c for c in contenders if mode in c.modes and (c.name, mode) not in out.failures]
            shift = round_index % max(len(group), 1)
            group = group[shift:] + group[:shift]
            _timed(run_hand, work, mode)  # discarded: the first run after a mode switch starts cold
            before = _timed(run_hand, work, mode)
            out.hand_first[mode].append(before)
            out.hand_all[mode].append(before)
            for contender in group:
                result = _timed(contender.run, work, mode)
                after = _timed(run_hand, work, mode)
                out.hand_all[mode].append(after)
                samples = out.results.setdefault((contender.name, mode), Samples())
                samples.runs.append(result)
                samples.hand_before.append(before)
                samples.ratios.append(result.per_step / ((before.per_step + after.per_step) / 2))
                before = after
        log(f"round {round_index + 1}/{repeats} done")
    return out


def warm_up(work: Workload, contenders: Sequence[Contender],
            modes: Sequence[str] = MODES) -> dict[tuple[str, str], str]:
    """One short run of everything: first calls pay for lazy imports and allocator growth.

    Returns the error of each (loop, mode) whose run raised (say, a loader `prepare()` refuses):
    the table reports it in that row, and the other rows are still measured.
    """
    short = dataclasses.replace(work, steps=min(work.steps, 60))
    failures = {}
    for mode in modes:
        run_hand(short, mode)
        for contender in contenders:
            if mode in contender.modes:
                try:
                    contender.run(short, mode)
                except Exception as error:  # noqa: BLE001 - reported in the table, and main exits 1
                    message = (str(error).splitlines() or [""])[0][:200].replace("|", "/")
                    failures[(contender.name, mode)] = f"{type(error).__name__}: {message}"
    return failures


# --------------------------------------------------------------------------- report
def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"≤{target:.2f}× ✅" if ratio <= target else f"≤{target:.2f}× ❌"


def format_table(measured: Measurement, contenders: Sequence[Contender]) -> str:
    """A markdown table, one row per loop and batch mode."""
    lines = ["| loop | batches | µs/step | × hand | × hand, median of pairs | fixed ms per run | target |",
             "|---|---|---:|---:|---:|---:|---|"]
    for mode in measured.hand_first:
        base = quiet_per_step(measured.hand_first[mode])
        fixed = statistics.median(r.fixed for r in measured.hand_all[mode])
        lines.append(f"| hand-written loop (baseline) | {MODE_TITLES[mode]} | {base * 1e6:.1f} | 1.000× | 1.000× | "
                     f"{fixed * 1e3:.1f} | |")
        for contender in contenders:
            samples = measured.results.get((contender.name, mode))
            failure = measured.failures.get((contender.name, mode))
            if failure is not None:
                lines.append(f"| {contender.name} | {MODE_TITLES[mode]} | – | – | – | – | failed: {failure} |")
            if samples is None:
                continue
            ratio = samples.quiet_ratio
            lines.append(f"| {contender.name} | {MODE_TITLES[mode]} | {samples.quiet * 1e6:.1f} | {ratio:.3f}× | "
                         f"{statistics.median(samples.ratios):.3f}× | {samples.fixed * 1e3:.1f} | "
                         f"{_verdict(ratio, contender.target.get(mode))} |")
    return "\n".join(lines)


def _noise(measured: Measurement) -> str:
    parts = []
    for mode in measured.hand_all:
        steps = sorted(r.per_step * 1e6 for r in measured.hand_all[mode])
        parts.append(f"{MODE_TITLES[mode]} {steps[0]:.0f}–{steps[-1]:.0f} µs/step (median "
                     f"{statistics.median(steps):.0f}) over {len(steps)} runs")
    return "Hand-loop run means, a measure of this machine's noise: " + "; ".join(parts) + "."


def control_warning(results: dict[tuple[str, str], Samples]) -> list[str]:
    """Warnings for modes whose A/A control strays: their ratios are not precise enough to judge."""
    warnings_ = []
    for mode in MODES:
        samples = results.get((AA_CONTROL, mode))
        if samples is not None and abs(samples.quiet_ratio - 1) > AA_TOLERANCE:
            warnings_.append(f"Warning: in {MODE_TITLES[mode]} mode the A/A control reads {samples.quiet_ratio:.3f}×, "
                             f"more than {AA_TOLERANCE:.0%} off: this machine is too busy to judge these ratios to "
                             "the targets' precision. Rerun on an idle machine, or with more --repeats.")
    return warnings_


def describe_machine() -> str:
    """One line for the README: CPU, cores, Python and torch versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread")


# --------------------------------------------------------------------------- profiling
def profile(work: Workload, contender: Contender, mode: str, top: int = 25) -> str:
    """cProfile of one run of `contender` and of the hand loop: calls per step and the top functions.

    cProfile inflates every Python call, so read it for *where* time goes and how many calls a
    step makes, and read the timed table for how much.
    """
    out = io.StringIO()
    calls = {}
    for name, run in (("hand loop", run_hand), (contender.name, contender.run)):
        run(work, mode)  # warm
        profiler = cProfile.Profile()
        profiler.enable()
        run(work, mode)
        profiler.disable()
        stats = pstats.Stats(profiler, stream=out)
        calls[name] = stats.total_calls / work.steps
        if run is contender.run:
            out.write(f"\n=== {contender.name} ({MODE_TITLES[mode]}): top {top} by own time\n")
            stats.sort_stats("tottime").print_stats(top)
            out.write("\n=== fittrain's and the callbacks' own functions, by cumulative time\n")
            stats.sort_stats("cumtime").print_stats(r"fittrain|callbacks", top)
    summary = ", ".join(f"{name}: {n:.1f}" for name, n in calls.items())
    return f"Python function calls per step — {summary}\n" + out.getvalue()


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=501,
                        help="optimizer steps per run (default 501: 500 timed intervals, one checkpoint)")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 101 steps, 2 rounds")
    parser.add_argument("--only", default=None, help="run only the loops whose name contains this text")
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="cProfile the first loop whose name contains NAME instead of timing")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter (default); cpu: this process's CPU time, steadier on a busy "
                             "shared machine (it still counts the process's own threads, such as TensorBoard's)")
    parser.add_argument("--mode", choices=MODES, default="prebuilt", help="batch mode for --profile")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated batch modes to time (default: all, {','.join(MODES)})")
    parser.add_argument("--workers-row", action="store_true",
                        help=f"instead of the table: samples/s of Trainer.fit and the hand loop over an "
                             f"IterableDataset with num_workers={loaders.WORKERS}, alternating --repeats rounds")
    args = parser.parse_args(argv)
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes takes a comma-separated list of {', '.join(MODES)}. Received: --modes "
                     f"{','.join(args.modes)!r}. Name one or more of those modes, e.g. --modes batched,stream.")
    if args.quick:
        args.steps, args.repeats = 101, 2
    if args.steps < 2 or args.repeats < 1:
        parser.error(f"--steps must be at least 2 and --repeats positive. "
                     f"Received: steps={args.steps}, repeats={args.repeats}.")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark (or one profile) and prints, and returns, its report."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # one thread: overhead, not intra-op parallelism, is what is measured
    warnings.filterwarnings("ignore")  # e.g. TensorBoard deprecation chatter in the Logger rows
    contenders, notes = available(CONTENDERS, args.profile or args.only)
    work = make_workload(args.steps, time.perf_counter if args.clock == "wall" else time.process_time)
    if args.profile:
        if not any(c.name != AA_CONTROL for c in contenders):
            raise SystemExit(f"--profile {args.profile!r} matches no runnable loop. {' '.join(notes)}")
        report = profile(work, next(c for c in contenders if c.name != AA_CONTROL), args.mode)
        print(report)
        return report
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.workers_row:
        report = loaders.measure_workers(work, BATCH_SIZE, args.repeats, log)
        print(report)
        return report
    log(f"overhead: {len(contenders)} loops × {len(args.modes)} modes, {args.steps} steps, {args.repeats} rounds")
    failures = warm_up(work, contenders, args.modes)
    measured = measure(work, contenders, args.repeats, log, args.modes, failures)
    lines = [f"Per-step time, tiny MLP {IN_FEATURES}→{HIDDEN}→{HIDDEN}→{OUT_FEATURES}, batch {BATCH_SIZE}, "
             f"SGD+momentum, CPU, {args.steps} steps per run, {args.repeats} alternating rounds, {args.clock} clock.",
             f"Machine: {describe_machine()}.", "", format_table(measured, contenders), "",
             "µs/step: for each step position the fastest of the runs, averaged over the steps (interference is "
             "removed, work that every run repeats at that step is kept); × hand: that over the same for the hand "
             "runs just before. Median of pairs: each run's mean step over the mean of the hand runs just before "
             "and after it (noisier). Fixed: one run's setup and teardown outside the timed steps.", _noise(measured)]
    lines += control_warning(measured.results)
    lines += [f"Note: {note}." for note in notes]
    report = "\n".join(lines)
    print(report)
    if measured.failures:
        raise SystemExit(f"overhead: {len(measured.failures)} row(s) could not run (see 'failed:' in the table).")
    return report


if __name__ == "__main__":
    main()
