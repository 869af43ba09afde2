"""`save_state`/`load_state` against saving and loading the same tensors by hand.

The state is an MLP (6 layers of 2048x2048 by default) with its AdamW state after one step:
parameters plus two moments, about 300 MB. Every contender writes or reads those tensors:

- **save_state / load_state**: fittrain's checkpoint (atomic folder, manifest with sizes and
  CRC32s, every file and the folder fsynced; loading verifies every file's CRC32 before parsing
  it, then restores model, optimizer and RNG).
- **by hand, durable** (the baseline the ratios and the target use): the same files save_state
  writes for these tensors, written the obvious way: ``safetensors.torch.save_file`` of the
  model's state dict and ``torch.save`` of the optimizer's, then ``fsync`` of both files and of
  the folder. Loading is ``load_file`` + ``torch.load(weights_only=True)`` of those files and
  ``load_state_dict``, with no verification. The fsyncs make it fair: save_state guarantees the
  files are on disk when it returns, and a save that skips fsync only reaches the page cache, so
  a crash or power cut can lose or truncate it. Comparing a durable save against a page-cache
  one measures the disk, not the code.
- For reference, not for the target: the same by hand without fsync (page cache only), and
  all-safetensors / all-torch.save variants (optimizer flattened for safetensors), with and
  without fsync, and a load with ``torch.load(mmap=True)``, which is what load_state uses for
  ``.pt`` files (except on Windows): tensors are mapped, copy-on-write, and read on first use.

Runs alternate (contenders in rotated order each round, round 0 a discarded warm-up) and the
table shows each contender's median and save_state's ratio to it.

A second part measures **save_state(async_save=True)**, each save followed by one training step
of the same model: the training stall is the time until the call returns plus how much longer
that step took than the step after a synchronous save (the optimizer step waits for the copy of
the parameters and optimizer state that the writing thread makes, and that thread takes CPU from
the step), against the target "stall ≤ 2% of a synchronous save". Beside it, in the same rounds,
the async save as it was before (everything copied at the call). Files are written to a
temporary folder on the same file system as `--dir` and deleted after each round. On a shared,
noisy machine use several rounds and read the ratios, not single timings.

Usage:
    python -m benchmarks.checkpoint                   # ~300 MB, 5 rounds
    python -m benchmarks.checkpoint --mb 100 --repeats 3
    python -m benchmarks.checkpoint --profile         # cProfile one save_state and one load_state
    python -m benchmarks.checkpoint --async-only      # only the async_save stall
    python -m benchmarks.checkpoint --fsdp            # FSDP2 on 2 and 4 processes: full vs sharded vs DCP
    python -m benchmarks.checkpoint --fsdp-table      # FSDP2 scaling: 3 sizes x 1, 2, 4 processes

The FSDP2 part (`--fsdp`, `--fsdp-table`, with their own flags: `--fsdp --help`) lives in
benchmarks/checkpoint_fsdp.py.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import math
import os
import pathlib
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fittrain import Accelerator  # noqa: E402

BASELINE = "by hand, durable"
# A load into an optimizer that has no state yet (a resumed process): the state's memory is new.
FRESH, FRESH_BASELINE = "load_state, fresh optim.", "by hand, fresh optim."
LOAD_BEFORE = "before 12-03, fresh optim."  # load_state as it was, side by side (`load_as_before`)
HIDDEN = 2048
BYTES_PER_PARAM = 12  # fp32 weights plus AdamW's two fp32 moments


def build(mb: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    """A prepared MLP of about `mb` megabytes of weights plus AdamW state, after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(_layers(mb))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, HIDDEN)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return accelerator, model, optimizer


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flat_optimizer(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, s in state_dict["state"].items() for k, v in s.items()}


def _unflat_optimizer(flat: dict[str, torch.Tensor], template: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": template["param_groups"]}


class Contenders:
    """The save and load functions being compared, all over the same live objects."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.acc, self.model, self.opt = accelerator, model, optimizer

    def save_state(self, folder: pathlib.Path) -> None:
        self.acc.save_state(folder)

    def load_state(self, folder: pathlib.Path) -> None:
        self.acc.load_state(folder)

    def save_by_hand(self, folder: pathlib.Path, fsync: bool = False) -> None:
        folder.mkdir()
        safetensors.torch.save_file(self.model.state_dict(), folder / "model.safetensors",
                                    metadata={"format": "pt"})
        torch.save(self.opt.state_dict(), folder / "optimizer.pt")
        if fsync:
            for path in (folder / "model.safetensors", folder / "optimizer.pt", folder):
                _fsync(path)

    def load_by_hand(self, folder: pathlib.Path, mmap: bool = False) -> None:
        self.model.load_state_dict(safetensors.torch.load_file(folder / "model.safetensors"))
        self.opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, mmap=mmap))

    def save_safetensors(self, folder: pathlib.Path, fsync: bool = False) -> None:
        folder.mkdir()
        safetensors.torch.save_file(self.model.state_dict(), folder / "model.safetensors")
        safetensors.torch.save_file(_flat_optimizer(self.opt.state_dict()), folder / "optimizer.safetensors")
        if fsync:
            for path in (folder / "model.safetensors", folder / "optimizer.safetensors", folder):
                _fsync(path)

    def load_safetensors(self, folder: pathlib.Path) -> None:
        self.model.load_state_dict(safetensors.torch.load_file(folder / "model.safetensors"))
        flat = safetensors.torch.load_file(folder / "optimizer.safetensors")
        self.opt.load_state_dict(_unflat_optimizer(flat, self.opt.state_dict()))

    def save_torch(self, folder: pathlib.Path, fsync: bool = False) -> None:
        folder.mkdir()
        torch.save(self.model.state_dict(), folder / "model.pt")
        torch.save(self.opt.state_dict(), folder / "optimizer.pt")
        if fsync:
            for path in (folder / "model.pt", folder / "optimizer.pt", folder):
                _fsync(path)

    def load_torch(self, folder: pathlib.Path) -> None:
        self.model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
        self.opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))

    def fresh(self, load: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
        """`load` into an optimizer without state, as in a resumed process (the clearing is timed too:
        freeing memory costs little next to a load)."""
        def run(folder: pathlib.Path) -> None:
            self.opt.optimizer.state.clear()
            load(folder)
        return run

    def pairs(self) -> dict[str, tuple[Callable[[pathlib.Path], None], Callable[[pathlib.Path], None]]]:
        return {
            "save_state/load_state": (self.save_state, self.load_state),
            BASELINE: (lambda f: self.save_by_hand(f, fsync=True), self.load_by_hand),
            FRESH: (self.save_state, self.fresh(self.load_state)),
            FRESH_BASELINE: (lambda f: self.save_by_hand(f, fsync=True), self.fresh(self.load_by_hand)),
            LOAD_BEFORE: (self.save_state, self.fresh(load_as_before(self.load_state))),
            "by hand, page cache": (self.save_by_hand, lambda f: self.load_by_hand(f, mmap=True)),
            "safetensors": (self.save_safetensors, self.load_safetensors),
            "torch.save/load": (self.save_torch, self.load_torch),
            "safetensors + fsync": (lambda f: self.save_safetensors(f, fsync=True), self.load_safetensors),
            "torch.save + fsync": (lambda f: self.save_torch(f, fsync=True), self.load_torch),
        }


def _buffered_checksum(path: Any, expected_size: int | None = None) -> tuple[int, int]:
    """The checksum pass load_state made before 2026-12-03: each part of the file read into a 1 MiB
    buffer (a copy of every byte) on its own thread, then checksummed."""
    from fittrain.checkpoint import crc

    size = os.stat(path).st_size
    if size == 0 or (expected_size is not None and size != expected_size):
        return size, 0
    parts = max(1, min(4, crc._cores(), size // crc.PARALLEL_MIN_BYTES))
    bounds = [size * i // parts for i in range(parts + 1)]
    results = [(0, 0)] * parts

    def run(i: int) -> None:
        buffer = memoryview(bytearray(1024 * 1024))
        value, position = 0, bounds[i]
        with open(path, "rb", buffering=0) as f:
            f.seek(position)
            while position < bounds[i + 1]:
                count = f.readinto(buffer[:min(len(buffer), bounds[i + 1] - position)])
                value, position = crc.crc32(buffer[:count], value), position + count
        results[i] = (position - bounds[i], value)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    value = 0
    for count, part in results:
        value = crc.crc32_combine(value, part, count)
    return size, value


def load_as_before(load: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], None]:
    """`load` as load_state was before 2026-12-03, for the side-by-side row: the buffered checksum
    pass, and every loaded tensor copied out of its file's map (into new memory, also the
    optimizer's state, which is now copied into its live tensors)."""
    import unittest.mock

    from fittrain.checkpoint import reader, restore

    def run(folder: pathlib.Path) -> None:
        with unittest.mock.patch.object(reader, "file_checksum", _buffered_checksum), \
                unittest.mock.patch.object(reader, "_as_is", reader._owned), \
                unittest.mock.patch.object(restore, "own_optimizer_state", lambda optimizer, saved: saved):
            load(folder)
    return run


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(contenders: Contenders, root: pathlib.Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Alternating rounds; returns {contender: {"save": [...], "load": [...]}}."""
    pairs = contenders.pairs()
    names = list(pairs)
    times = {name: {"save": [], "load": []} for name in names}
    for round_index in range(repeats + 1):  # round 0 warms caches and allocators; not counted
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            save, load = pairs[name]
            folder = root / f"r{round_index}_{name.replace('/', '_').replace(' ', '')}"
            save_s = _timed(functools.partial(save, folder))
            load_s = _timed(functools.partial(load, folder))
            shutil.rmtree(folder)
            if round_index:
                times[name]["save"].append(save_s)
                times[name]["load"].append(load_s)
    return times


def report(times: dict[str, dict[str, list[float]]], megabytes: float) -> None:
    medians = {name: {op: statistics.median(v) for op, v in ops.items()} for name, ops in times.items()}
    rounds = len(times[BASELINE]["save"])
    print(f"\nState: {megabytes:.0f} MB (model + AdamW moments). Medians of {rounds} alternating rounds.")
    print("(The 'by hand, page cache' row loads with torch.load(mmap=True), like load_state.)\n")
    print(f"{'contender':<24} {'save s':>8} {'load s':>8}   {'save_state ÷ it':>16} {'load_state ÷ it':>16}")
    print("-" * 78)
    ours = medians["save_state/load_state"]
    for name, m in medians.items():
        if name == "save_state/load_state":
            print(f"{name:<24} {m['save']:8.3f} {m['load']:8.3f}")
        else:
            print(f"{name:<24} {m['save']:8.3f} {m['load']:8.3f}   {ours['save'] / m['save']:15.2f}x "
                  f"{ours['load'] / m['load']:15.2f}x")
    base = medians[BASELINE]
    print(f"\nTarget ≤ 1.10x against '{BASELINE}': save {ours['save'] / base['save']:.2f}x, "
          f"load {ours['load'] / base['load']:.2f}x; into a fresh optimizer (a resumed process), load "
          f"{medians[FRESH]['load'] / medians[FRESH_BASELINE]['load']:.2f}x (before 2026-12-03: "
          f"{medians[LOAD_BEFORE]['load'] / medians[FRESH_BASELINE]['load']:.2f}x).")


#: The async variants: today's (parameters and optimizer state copied on the writing thread, the next
#: optimizer step waiting for that copy) and the one before it, everything copied at the call.
ASYNC, ASYNC_AT_CALL = "async", "async, all copied at the call (before)"


def _train_step(contenders: Contenders, batch: torch.Tensor) -> float:
    """Seconds of one training step (forward, backward, AdamW step) of the benchmark's model."""
    start = time.perf_counter()
    contenders.model(batch).square().mean().backward()
    contenders.opt.step()
    contenders.opt.zero_grad()
    return time.perf_counter() - start


def run_async(contenders: Contenders, root: pathlib.Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Alternates a sync save_state and the two async variants, each followed by one training step;
    round 0 is a warm-up (it allocates the CPU buffers that later async saves reuse).

    Returns:
        {variant: {"call": seconds until save_state returned, "step": the training step right after,
        "write": seconds from the return until the write was complete}}. The training stall of an
        async save is its call plus how much longer its step took than the step after a sync save
        (nothing in flight then): the wait of the optimizer step for the copy, and the CPU the
        writing thread takes from the step.
    """
    import unittest.mock

    from fittrain.accelerator.checkpointing import Checkpointing

    batch = torch.randn(64, HIDDEN)
    kinds = ("sync", ASYNC, ASYNC_AT_CALL)
    times = {kind: {"call": [], "step": [], "write": []} for kind in kinds}
    for round_index in range(repeats + 1):
        order = kinds[round_index % 3:] + kinds[:round_index % 3]
        for kind in order:
            folder = root / f"a{round_index}_{kinds.index(kind)}"
            # Without the parameters' storage, capture_state copies everything at the call, as it did before.
            at_call = unittest.mock.patch.object(Checkpointing, "_parameter_storage", lambda self: None)
            with at_call if kind == ASYNC_AT_CALL else contextlib.nullcontext():
                start = time.perf_counter()
                contenders.acc.save_state(folder, async_save=kind != "sync")
                returned = time.perf_counter()
                step = _train_step(contenders, batch)
                contenders.acc.wait_for_checkpoint()
                done = time.perf_counter()
            shutil.rmtree(folder)
            if round_index:
                for key, value in (("call", returned - start), ("step", step), ("write", done - returned)):
                    times[kind][key].append(value)
    return times


def report_async(times: dict[str, dict[str, list[float]]], megabytes: float) -> None:
    median = {kind: {key: statistics.median(v) for key, v in parts.items()} for kind, parts in times.items()}
    sync = median["sync"]
    rounds = len(times["sync"]["call"])
    print(f"\nsave_state(async_save=True), {megabytes:.0f} MB, then one training step (batch 64); medians of "
          f"{rounds} alternating rounds:")
    print(f"  {'':44} {'call s':>8} {'step s':>8} {'stall s':>8} {'stall ÷ sync save':>18}")
    print(f"  {'synchronous save_state':44} {sync['call']:8.3f} {sync['step']:8.3f}")
    for kind in (ASYNC, ASYNC_AT_CALL):
        m = median[kind]
        stall = m["call"] + max(0.0, m["step"] - sync["step"])
        print(f"  {kind:44} {m['call']:8.3f} {m['step']:8.3f} {stall:8.3f} {stall / sync['call']:17.1%}")
    call = median[ASYNC]["call"] / sync["call"]
    verdict = "met" if call <= 0.02 else "not met"
    print(f"\nThe call (the time training is blocked before it goes on): {call:.1%} of a synchronous save; "
          f"target ≤ 2%: {verdict}.")
    print("Stall: the call, plus how much longer the next training step took than after a synchronous save: "
          "the wait of its optimizer step for the background copy, and the CPU that the writing thread "
          "(checksums, writes) takes from the step, most of it on a CPU-only machine.")
    print(f"Memory: one CPU copy of the state ({megabytes:.0f} MB), kept from the first async save on.")


def profile(contenders: Contenders, root: pathlib.Path) -> None:
    for op in ("save", "load"):
        folder = root / "profiled"
        if op == "save":
            shutil.rmtree(folder, ignore_errors=True)
            contenders.save_state(folder)  # warm-up
            shutil.rmtree(folder)
        profiler = cProfile.Profile()
        profiler.enable()
        (contenders.save_state if op == "save" else contenders.load_state)(folder)
        profiler.disable()
        print(f"\n==== {op}_state ====")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    shutil.rmtree(root / "profiled", ignore_errors=True)


def _load_in_a_fresh_process(kind: str, folder: pathlib.Path, mb: int) -> float:
    """Seconds of one load into a new model and an optimizer without state, in a new process: what a
    resumed job does (`--fresh-process`). `kind` is "load_state" or "by hand"."""
    code = ("import sys, time, pathlib, torch; sys.argv = ['x']; from benchmarks import checkpoint as c\n"
            f"torch.set_num_threads({max(1, os.cpu_count() or 1)}); torch.manual_seed(1)\n"
            f"acc = c.Accelerator(cpu=True); model = c.nn.Sequential(*[c.nn.Linear(c.HIDDEN, c.HIDDEN) "
            f"for _ in range({_layers(mb)})])\n"
            "model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))\n"
            "contenders = c.Contenders(acc, model, opt)\n"
            f"load = contenders.load_state if {kind!r} == 'load_state' else contenders.load_by_hand\n"
            f"start = time.perf_counter(); load(pathlib.Path({str(folder)!r})); print(time.perf_counter() - start)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def _layers(mb: int) -> int:
    return max(1, math.ceil(mb * 1e6 / BYTES_PER_PARAM / (HIDDEN * HIDDEN)))


def run_fresh_process(contenders: Contenders, root: pathlib.Path, repeats: int, mb: int) -> None:
    """`--fresh-process`: load_state and the by-hand load, each into a new process's fresh model and
    optimizer (a resumed job), alternating; prints the medians and their ratio."""
    ours, hand = root / "ours", root / "hand"
    contenders.save_state(ours)
    contenders.save_by_hand(hand, fsync=True)
    times: dict[str, list[float]] = {"load_state": [], "by hand": []}
    for round_index in range(repeats):
        for kind in (("load_state", "by hand") if round_index % 2 else ("by hand", "load_state")):
            times[kind].append(_load_in_a_fresh_process(kind, ours if kind == "load_state" else hand, mb))
    a, b = statistics.median(times["load_state"]), statistics.median(times["by hand"])
    print(f"\nLoad into a fresh process (new model, optimizer without state), medians of {repeats} alternating "
          f"runs: load_state {a:.3f} s, by hand {b:.3f} s: {a / b:.2f}x (target ≤ 1.10x).")


def main() -> None:
    if {"--fsdp", "--fsdp-table"} & set(sys.argv[1:]):
        from benchmarks import checkpoint_fsdp

        checkpoint_fsdp.main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=300, help="approximate size of model + optimizer state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary folder)")
    parser.add_argument("--profile", action="store_true", help="cProfile one save_state and one load_state")
    parser.add_argument("--async-only", action="store_true", help="measure only the async_save stall")
    parser.add_argument("--fresh-process", action="store_true",
                        help="only the load into a new process (a resumed job), alternating with the by-hand load")
    # Handled above, by benchmarks.checkpoint_fsdp; listed here for --help.
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 on 2 and 4 processes (see `--fsdp --help`)")
    parser.add_argument("--fsdp-table", action="store_true", help="FSDP2 scaling table (see `--fsdp --help`)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    accelerator, model, optimizer = build(args.mb)
    megabytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
    contenders = Contenders(accelerator, model, optimizer)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fittrain-ckpt-bench-") as tmp:
        root = pathlib.Path(tmp)
        if args.profile:
            profile(contenders, root)
            return
        if args.fresh_process:
            run_fresh_process(contenders, root, args.repeats, args.mb)
            return
        if not args.async_only:
            report(run(contenders, root, args.repeats), megabytes)
        report_async(run_async(contenders, root, args.repeats), megabytes)


if __name__ == "__main__":
    main()
