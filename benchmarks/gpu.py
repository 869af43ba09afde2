"""bf16 and fp16 throughput of `Trainer.fit` against a hand-written `torch.autocast` loop, on a GPU.

The model is a stack of `nn.TransformerEncoderLayer` blocks (pre-norm, GELU, no dropout) between
a token embedding and a vocabulary head, trained with AdamW on cross-entropy against random
target tokens. The defaults (d_model 1024, 16 heads, 8 layers, vocabulary 8192: 118M parameters;
16 sequences of 512 tokens) come to about 6 TFLOP a step, some 10-30 ms on an H200: a real
step, yet short enough that a framework's Python per step would show. Two loops train the same
weights on the same batches, in each precision:

- **hand loop**: `with torch.autocast("cuda", dtype=...)`: forward and loss; for fp16 a
  `torch.amp.GradScaler` scales the loss and steps the optimizer; `zero_grad(set_to_none=True)`.
- **Trainer.fit**: `Trainer(callbacks=[MixedPrecision(...)], max_steps=N).fit(module, batches)`,
  with no other callbacks.

The batches are built once, on the device, before anything is timed, so the data pipeline is no
part of either loop. Both loops iterate the same sequence of them: the hand loop directly,
`Trainer.fit` as its list of ready batches (fit takes one as it takes a DataLoader).

What is timed: both batch sources call the same clock when they hand out a batch. At the hand-out
of batch number `--warmup` (all earlier steps are warm-up: cuBLAS and attention-kernel choice,
the optimizer's lazily created state, the GradScaler's first skipped steps) the clock calls
`torch.cuda.synchronize()` and starts; after the loop, or after `fit` returns, it synchronizes
again and stops. So the timed region is exactly the last `--steps` steps, finished on the GPU,
with no synchronization in between beyond what each loop does itself (for fp16, GradScaler's
check for infinite gradients). For `Trainer.fit` it also includes what `fit` does after its
last step (the `on_fit_end` event, restoring signal handlers), which is microseconds against
seconds of steps. Setup before the first step (the Trainer's `prepare`) is warm-up, outside.

Runs alternate: each round runs the hand loop, `Trainer.fit` and the hand loop again (an A/A
control, whose ratio is this run's measurement error) per precision, in an order rotated every
round; a short untimed run of each loop comes first. Interference only ever slows a run down, so
the table shows each loop's best run, and the ratio divides the best Trainer run by the best hand
run; the median of the per-round ratios is shown beside it.

Target: Trainer.fit's bf16 throughput ≥ 0.97× the hand loop's on a GPU.

Usage:
    python -m benchmarks.gpu                    # 1-3 minutes on an H200 (estimated from the FLOPs: 3,550 steps)
    python -m benchmarks.gpu --quick            # under a minute (670 steps)
    python benchmarks/gpu.py --layers 12 --seq 1024 --batch 8
    python -m benchmarks.gpu --device cpu --quick   # the same comparison, tiny, on the CPU (a smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable, Iterator, Sequence

if not __package__:  # run as a script: make the checkout importable even when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch import nn
from torch.nn import functional as F

from fittrain import Accelerator, Trainer, TrainModule
from fittrain.callbacks import MixedPrecision

TARGETS = {"bf16": 0.97}  # on a GPU; the CPU smoke run reports no verdicts
AA_TOLERANCE = 0.01  # the hand loop against itself may stray this far before the target cannot be judged
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DISTINCT_BATCHES = 8  # pre-built and cycled: enough to vary the data, little device memory
NO_CUDA = ("no CUDA device: the gpu benchmark needs one; run `python -m benchmarks.gpu --device cpu --quick` "
           "for a CPU smoke run of the same comparison.")

# Sizes per device: an H200-sized step, and a tiny one that a 2-core CPU runs in seconds.
DEFAULTS = {
    "cuda": dict(d_model=1024, heads=16, layers=8, seq=512, batch=16, vocab=8192, steps=100, warmup=15, repeats=5),
    "cpu": dict(d_model=32, heads=2, layers=2, seq=16, batch=4, vocab=64, steps=20, warmup=3, repeats=3),
}
QUICK = {"cuda": dict(steps=40, warmup=10, repeats=2), "cpu": dict(steps=6, warmup=2, repeats=1)}

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- the model
@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of the model and of a batch."""

    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    vocab: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (autocast runs it in float32)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class BlockStack(TrainModule):
    """Embedding → `layers` pre-norm TransformerEncoderLayers → LayerNorm → vocabulary head.

    The hand loop uses this very class, so both loops run the same forward and loss.
    """

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.d_model)
        layer = nn.TransformerEncoderLayer(config.d_model, config.heads, 4 * config.d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens))))

    def training_step(self, batch: Batch) -> torch.Tensor:
        tokens, targets = batch
        return lm_loss(self(tokens), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


# --------------------------------------------------------------------------- the clock
class WarmupClock:
    """Starts at the hand-out of batch number `warmup`, after a device sync; `stop` syncs and stops.

    Both loops' batch sources call `tick` once per batch, so the timed region starts at the same
    point of the loop in each: after the previous step's `zero_grad`, before the next forward.
    """

    def __init__(self, warmup: int, synchronize: Callable[[], None]) -> None:
        self.warmup = warmup
        self.synchronize = synchronize
        self.handed_out = 0
        self.start = self.end = 0.0

    def tick(self) -> None:
        if self.handed_out == self.warmup:
            self.synchronize()
            self.start = time.perf_counter()
        self.handed_out += 1

    def stop(self) -> None:
        self.synchronize()
        self.end = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.handed_out <= self.warmup:
            raise RuntimeError(f"Only {self.handed_out} batch(es) were handed out, none after the {self.warmup} "
                               "warm-up steps. Use --steps 1 or more.")
        return self.end - self.start


class TickingBatches:
    """`total` batches cycled from the pre-built list, ticking the clock at each hand-out.

    Both loops iterate this: the hand loop directly, `Trainer.fit` as its list of ready batches
    (a sized, re-iterable sequence; one epoch covers the whole run, so `fit` crosses no epoch
    boundary the hand loop lacks).
    """

    def __init__(self, batches: list[Batch], total: int, clock: WarmupClock) -> None:
        self.batches, self.total, self.clock = batches, total, clock

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[Batch]:
        for index in range(self.total):
            self.clock.tick()
            yield self.batches[index % len(self.batches)]


# --------------------------------------------------------------------------- the workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """Everything a run needs, built once so every run starts from the same weights and data."""

    config: Config
    device: torch.device
    batches: list[Batch]
    init_state: dict[str, torch.Tensor]
    steps: int
    warmup: int

    @property
    def total(self) -> int:
        return self.warmup + self.steps

    def model(self) -> BlockStack:
        """A fresh model on the device with the shared initial weights."""
        with torch.device(self.device):
            model = BlockStack(self.config)
        model.load_state_dict(self.init_state)
        return model

    def clock(self) -> WarmupClock:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        return WarmupClock(self.warmup, sync)


def make_workload(config: Config, device: torch.device, steps: int, warmup: int) -> Workload:
    """Random tokens and one set of initial weights, from fixed seeds, on `device`."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(DISTINCT_BATCHES):
        tokens = torch.randint(config.vocab, (config.batch, config.seq + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    torch.manual_seed(0)
    with torch.device(device):
        init_state = {k: v.clone() for k, v in BlockStack(config).state_dict().items()}
    return Workload(config, device, batches, init_state, steps, warmup)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One timed run: seconds for the timed steps, and the last loss (a check that both learned alike)."""

    seconds: float
    steps: int
    tokens_per_step: int
    final_loss: float

    @property
    def throughput(self) -> float:
        """Tokens per second over the timed steps."""
        return self.steps * self.tokens_per_step / self.seconds


# --------------------------------------------------------------------------- the loops
def run_hand(work: Workload, precision: str) -> RunResult:
    """The baseline: autocast forward and loss, (scaled) backward, step, zero_grad."""
    clock = work.clock()
    model = work.model()
    optimizer = model.configure_optimizers()
    device_type, dtype = work.device.type, DTYPES[precision]
    # bf16 has fp32's exponent range and needs no loss scaling: its loop is the plain one.
    scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
    model.train()
    loss = torch.zeros(())
    for tokens, targets in TickingBatches(work.batches, work.total, clock):
        with torch.autocast(device_type, dtype=dtype):
            loss = lm_loss(model(tokens), targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    clock.stop()
    return RunResult(clock.seconds, work.steps, work.config.tokens_per_step, float(loss.detach()))


def run_trainer(work: Workload, precision: str) -> RunResult:
    """`Trainer(callbacks=[MixedPrecision(precision)], max_steps=N).fit(module, batches)`."""
    clock = work.clock()
    project = tempfile.mkdtemp(prefix="fittrain-gpu-bench-")
    try:
        # Only the CPU smoke run needs its own Accelerator: the default one takes the GPU when present.
        accelerator = Accelerator(cpu=True) if work.device.type == "cpu" else None
        trainer = Trainer(callbacks=[MixedPrecision(precision)], max_steps=work.total, project_dir=project,
                          accelerator=accelerator)
        module = work.model()
        trainer.fit(module, TickingBatches(work.batches, work.total, clock))
        clock.stop()
    finally:
        shutil.rmtree(project, ignore_errors=True)
    if trainer.state.global_step != work.total:
        raise RuntimeError(f"Trainer.fit took {trainer.state.global_step} steps, expected {work.total}.")
    return RunResult(clock.seconds, work.steps, work.config.tokens_per_step, float(trainer.state.loss))


HAND, TRAINER = "hand loop + torch.autocast", "fittrain Trainer.fit + MixedPrecision"
AA_CONTROL = "hand loop again (A/A)"
LOOPS: dict[str, Callable[[Workload, str], RunResult]] = {HAND: run_hand, TRAINER: run_trainer, AA_CONTROL: run_hand}


# --------------------------------------------------------------------------- timing
def _timed(run: Callable[[Workload, str], RunResult], work: Workload, precision: str) -> RunResult:
    gc.collect()  # every run starts with the same garbage and the previous run's tensors freed
    return run(work, precision)


def measure(work: Workload, precisions: Sequence[str], repeats: int,
            log: Callable[[str], None]) -> dict[tuple[str, str], list[RunResult]]:
    """Runs hand, Trainer and hand again per precision and round, rotating the order every round."""
    short = dataclasses.replace(work, steps=2)
    for precision in precisions:  # untimed: first calls pay for kernels' selection and lazy imports
        for run in LOOPS.values():
            _timed(run, short, precision)
    results: dict[tuple[str, str], list[RunResult]] = {}
    names = list(LOOPS)
    start = time.perf_counter()
    for round_index in range(repeats):
        shift = round_index % len(names)
        for precision in precisions:
            for name in names[shift:] + names[:shift]:
                results.setdefault((name, precision), []).append(_timed(LOOPS[name], work, precision))
        elapsed = time.perf_counter() - start
        log(f"round {round_index + 1}/{repeats} done, {elapsed:.0f} s so far, about "
            f"{elapsed / (round_index + 1) * (repeats - round_index - 1):.0f} s to go")
    return results


# --------------------------------------------------------------------------- report
def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"≥{target:.2f}× {'✅' if ratio >= target else '❌'}"


def format_table(results: dict[tuple[str, str], list[RunResult]], precisions: Sequence[str],
                 work: Workload) -> str:
    """A markdown table, one row per loop and precision."""
    lines = ["| loop | precision | k tokens/s | samples/s | ms/step | × hand | × hand, median of rounds | "
             "final loss | target |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for precision in precisions:
        hand = results[(HAND, precision)]
        best_hand = max(r.throughput for r in hand)
        for name in LOOPS:
            runs = results[(name, precision)]
            best = max(r.throughput for r in runs)
            ratio = best / best_hand
            per_round = statistics.median(r.throughput / h.throughput for r, h in zip(runs, hand))
            target = TARGETS.get(precision) if name == TRAINER and work.device.type == "cuda" else None
            lines.append(f"| {name} | {precision} | {best / 1e3:.1f} | {best / work.config.seq:.1f} | "
                         f"{work.config.tokens_per_step / best * 1e3:.2f} | {ratio:.3f}× | {per_round:.3f}× | "
                         f"{statistics.median(r.final_loss for r in runs):.4f} | {_verdict(ratio, target)} |")
    return "\n".join(lines)


def _noise(results: dict[tuple[str, str], list[RunResult]], precisions: Sequence[str]) -> str:
    parts = []
    for precision in precisions:
        rates = sorted(r.throughput / 1e3 for name in (HAND, AA_CONTROL) for r in results[(name, precision)])
        parts.append(f"{precision} {rates[0]:.1f}–{rates[-1]:.1f} k tokens/s over {len(rates)} runs")
    return "Hand-loop runs, a measure of this machine's noise: " + "; ".join(parts) + "."


def control_warnings(results: dict[tuple[str, str], list[RunResult]], precisions: Sequence[str]) -> list[str]:
    """Warnings for precisions whose A/A control strays: their ratios are not precise enough to judge."""
    warnings_ = []
    for precision in precisions:
        best = {name: max(r.throughput for r in results[(name, precision)]) for name in (HAND, AA_CONTROL)}
        ratio = best[AA_CONTROL] / best[HAND]
        if abs(ratio - 1) > AA_TOLERANCE:
            warnings_.append(f"Warning: in {precision} the A/A control reads {ratio:.3f}×, more than "
                             f"{AA_TOLERANCE:.0%} off: this run cannot judge ratios to the target's precision. "
                             "Rerun on an idle device, or with more --steps or --repeats.")
    return warnings_


def describe_machine(device: torch.device) -> str:
    """One line: the GPU (or CPU), torch and CUDA versions, and the date."""
    today = datetime.date.today().isoformat()
    if device.type == "cuda":
        return (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"Python {platform.python_version()}, {today}")
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    return (f"{cpu} (CPU, {torch.get_num_threads()} threads), torch {torch.__version__}, "
            f"Python {platform.python_version()}, {today}")


def describe_model(config: Config, params: int) -> str:
    return (f"{config.layers} × TransformerEncoderLayer(d_model {config.d_model}, {config.heads} heads, FFN "
            f"{4 * config.d_model}, pre-norm), vocab {config.vocab}, {params / 1e6:.3g}M parameters, batch "
            f"{config.batch} × seq {config.seq} ({config.tokens_per_step} tokens/step), AdamW")


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu runs the same comparison with tiny sizes, as a smoke test")
    parser.add_argument("--precision", nargs="+", choices=tuple(DTYPES), default=list(DTYPES),
                        help="precisions to compare (default: bf16 fp16)")
    for name, help_ in (("d-model", "model width"), ("heads", "attention heads"), ("layers", "encoder layers"),
                        ("seq", "tokens per sequence"), ("batch", "sequences per batch"), ("vocab", "vocabulary size"),
                        ("steps", "timed steps per run"), ("warmup", "untimed steps at the start of each run"),
                        ("repeats", "alternating rounds")):
        defaults = ", ".join(f"{device} {sizes[name.replace('-', '_')]}" for device, sizes in DEFAULTS.items())
        parser.add_argument(f"--{name}", type=int, default=None, help=f"{help_} (default: {defaults})")
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and rounds: " + "; ".join(
                            f"{device} " + ", ".join(f"{k} {v}" for k, v in sizes.items())
                            for device, sizes in QUICK.items()))
    args = parser.parse_args(argv)
    sizes = dict(DEFAULTS[args.device], **(QUICK[args.device] if args.quick else {}))
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    bad = {name: getattr(args, name) for name in sizes
           if getattr(args, name) < (0 if name == "warmup" else 1)}
    if bad:
        parser.error(f"sizes, --steps and --repeats must be positive and --warmup not negative. Received: {bad}.")
    if args.d_model % args.heads:
        parser.error(f"--d-model must be a multiple of --heads. Received: d_model={args.d_model}, heads={args.heads}.")
    return args


def _supported(precisions: Sequence[str], device: torch.device) -> tuple[list[str], list[str]]:
    """The precisions this device runs, and a note for each one skipped."""
    chosen, notes = [], []
    for precision in dict.fromkeys(precisions):
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            notes.append(f"skipped bf16: {torch.cuda.get_device_name(device)} does not support it")
        elif not torch.amp.autocast_mode.is_autocast_available(device.type):
            notes.append(f"skipped {precision}: no autocast on {device.type}")
        else:
            chosen.append(precision)
    return chosen, notes


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark and prints, and returns, its report."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        return NO_CUDA
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    warnings.filterwarnings("ignore")
    precisions, notes = _supported(args.precision, device)
    if not precisions:
        raise SystemExit("No precision to run here: " + "; ".join(notes))
    config = Config(args.d_model, args.heads, args.layers, args.seq, args.batch, args.vocab)
    work = make_workload(config, device, args.steps, args.warmup)
    params = sum(t.numel() for t in work.init_state.values())
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"gpu: {len(LOOPS)} loops × {len(precisions)} precisions, {args.warmup}+{args.steps} steps, "
        f"{args.repeats} rounds, on {device}")
    results = measure(work, precisions, args.repeats, log)
    lines = [f"Training throughput, {describe_model(config, params)}, {device.type}, {args.steps} timed steps after "
             f"{args.warmup} warm-up steps per run, {args.repeats} alternating rounds.",
             f"Machine: {describe_machine(device)}.", "", format_table(results, precisions, work), "",
             "k tokens/s, samples/s, ms/step: each loop's best run; × hand: that over the hand loop's best run. "
             "Median of rounds: each run over the hand run of its round. Final loss: median over runs of the last "
             "step's loss (the loops train alike, so these agree to a few digits).", _noise(results, precisions)]
    if device.type == "cpu":
        lines.append("Note: a CPU smoke run with tiny sizes; the target is judged on a GPU only.")
    else:
        lines += control_warnings(results, precisions)
    lines += [f"Note: {note}." for note in notes]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
