"""FSDP2 checkpoints on N gloo processes (CPU): full against sharded save_state/load_state, and DCP's own.

Every process of a torchrun job holds its FSDP2 shard of an MLP (8 square layers, `--mb` MB of
float32 parameters) and of its AdamW state after one step, so the checkpointed state is 3 × `--mb`
(weights and two moments), a 1/N share of it per process. The contenders:

- **fittrain full**: `Accelerator(strategy="fsdp", state_dict_type="full")`: model and optimizer
  gathered to rank 0, written as model.safetensors + optimizer.pt; load reads them back and reshards.
- **fittrain sharded**: `state_dict_type="sharded"`: every rank writes its own shards with
  torch.distributed.checkpoint (DCP) into `shards/` (JSON metadata, nothing pickled).
- **DCP's own** (the load baseline): `dcp.save`/`dcp.load` of the same sharded state dicts
  (`get_model_state_dict`/`get_optimizer_state_dict`, `full_state_dict=False`) into a plain folder
  with DCP's defaults (one file per rank, fsynced), then `set_*_state_dict`.

Both fittrain contenders also write RNG states, a manifest with CRC32s of every file and fsync the
folder; their loads verify those CRC32s first. One job runs every contender, rotating their order
each round; round 0 is a warm-up that also checks each load restores what was saved (parameters and
moments are perturbed in between). A save or load is timed from a barrier to a barrier, so its time
is that of the slowest rank; tables show medians over rounds of that.

Memory: before each save or load a process resets its RSS high-water mark (`echo 5 >
/proc/self/clear_refs`) and reads its RSS; after it, VmHWM minus that RSS is the *extra* peak the
operation needed. Tables show the largest over ranks (rank 0, under "full"). Workers run with a
fixed glibc mmap threshold, so freed tensors go back to the OS and one contender's freed memory
cannot hide the next one's peak. Mapped files count while resident: the full load maps
optimizer.pt (fittrain's CRC32s are read through a small buffer, so they add nothing).

Targets (at `--mb`, 2 and 4 processes): sharded extra peak per rank ≤ 1.2 × its shard of model +
optimizer + 50 MB; sharded save ≤ full save; sharded load ≤ 1.1 × DCP's own load.

With one process FSDP2 does not shard (fittrain trains the model whole); "sharded" is then DCP's
file format for the whole state, written by one rank.

Usage:
    python -m benchmarks.checkpoint --fsdp                    # 2 and 4 processes, 32 MB, 3 rounds
    python -m benchmarks.checkpoint --fsdp --mb 64 --rounds 5
    python -m benchmarks.checkpoint --fsdp-table              # sizes 8, 32, 128 MB × 1, 2, 4 processes
    python -m benchmarks.checkpoint --fsdp-table --sizes 4 16 --processes 2
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

FULL, SHARDED, DCP = "fittrain full", "fittrain sharded", "DCP's own"
LAYERS = 8
MB = 1e6
TARGET_MEMORY_FACTOR, TARGET_MEMORY_SLACK_MB, TARGET_LOAD_RATIO = 1.2, 50.0, 1.1
# torchrun's variables, which must not leak from an outer launcher into a job's environment.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FITTRAIN_STRATEGY", "FSDP_STATE_DICT_TYPE")


# --------------------------------------------------------------------------- one worker process
def _width(mb: float) -> int:
    """The layer width giving about `mb` MB of parameters in LAYERS square layers; a multiple of 64,
    so every process count here shards every weight evenly."""
    return max(64, round(math.sqrt(mb * MB / 4 / LAYERS) / 64) * 64)


def _build(mb: float) -> tuple[Any, Any, Any]:
    """A prepared FSDP2 MLP with AdamW state after one step."""
    import torch
    from torch import nn

    from fittrain import Accelerator

    torch.manual_seed(0)
    width = _width(mb)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = Accelerator(cpu=True, strategy="fsdp", state_dict_type="sharded")
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return accelerator, model, optimizer


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line; this benchmark needs Linux's /proc.")


def _reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux ≥ 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _measure(operation: Callable[[], None]) -> tuple[float, float]:
    """Runs `operation` on every rank between barriers; returns (seconds, extra peak RSS in MB)."""
    gc.collect()
    _barrier()
    _reset_peak()
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    operation()
    _barrier()
    seconds = time.perf_counter() - start
    return seconds, (_status_bytes("VmHWM") - before) / MB


def _local_tensors(model: Any, optimizer: Any) -> list[Any]:
    """This rank's parameter shards and optimizer-state shards (views, not copies)."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p.data) for p in model.parameters()]
    for state in optimizer.optimizer.state.values():
        tensors += [local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensors


class _Contenders:
    """Save and load of each contender, all over the same live model and optimizer."""

    def __init__(self, accelerator: Any, model: Any, optimizer: Any) -> None:
        self.acc, self.model, self.opt = accelerator, model, optimizer

    def fittrain_save(self, kind: str, folder: pathlib.Path) -> None:
        self.acc.state_dict_type = kind  # the constructor's setting; save_state reads it each call
        self.acc.save_state(folder)

    def fittrain_load(self, folder: pathlib.Path) -> None:
        self.acc.load_state(folder)  # reads either kind, as the checkpoint says

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.opt.optimizer)}

    def dcp_save(self, folder: pathlib.Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=folder)

    def dcp_load(self, folder: pathlib.Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        state = self._dcp_state()
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.opt.optimizer, state["optimizer"])

    def pairs(self) -> dict[str, tuple[Callable[[pathlib.Path], None], Callable[[pathlib.Path], None]]]:
        return {FULL: (lambda f: self.fittrain_save("full", f), self.fittrain_load),
                SHARDED: (lambda f: self.fittrain_save("sharded", f), self.fittrain_load),
                DCP: (self.dcp_save, self.dcp_load)}


def _restores(contenders: _Contenders, save: Callable, load: Callable, folder: pathlib.Path) -> bool:
    """Saves, perturbs every local shard, loads, and tells whether the shards are back as saved."""
    import torch

    save(folder)
    tensors = _local_tensors(contenders.model, contenders.opt)
    saved = [t.clone() for t in tensors]
    with torch.no_grad():
        for t in tensors:
            t.add_(1.0)
    load(folder)
    return all(torch.equal(a, b) for a, b in zip(_local_tensors(contenders.model, contenders.opt), saved))


def _worker(args: argparse.Namespace) -> None:
    """One process of the job: alternating rounds; writes {out}/rank{r}.json."""
    import torch

    torch.set_num_threads(1)
    accelerator, model, optimizer = _build(args.mb)
    contenders = _Contenders(accelerator, model, optimizer)
    pairs = {name: pair for name, pair in contenders.pairs().items() if name in args.contenders}
    names = list(pairs)
    root = pathlib.Path(args.root)
    result: dict[str, Any] = {
        "shard_mb": sum(t.numel() * t.element_size() for t in _local_tensors(model, optimizer)) / MB,
        "width": _width(args.mb), "verified": {},
        "times": {name: {"save_s": [], "load_s": [], "save_mb": [], "load_mb": []} for name in names}}
    for round_index in range(args.rounds + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            save, load = pairs[name]
            folder = root / f"r{round_index}_{names.index(name)}"
            if not round_index:  # warm-up: also the check that the load restores the saved state
                result["verified"][name] = _restores(contenders, save, load, folder)
            else:
                times = result["times"][name]
                for op, fn in (("save", save), ("load", load)):
                    seconds, extra = _measure(functools.partial(fn, folder))
                    times[f"{op}_s"].append(seconds)
                    times[f"{op}_mb"].append(extra)
            _barrier()
            if accelerator.is_main_process:
                shutil.rmtree(folder)
            _barrier()
    pathlib.Path(args.out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


# --------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    # A fixed mmap threshold turns off glibc's adaptive one: tensors freed by one contender go
    # back to the OS instead of staying resident, where they would absorb the next one's peak.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               MALLOC_MMAP_THRESHOLD_="131072", FITTRAIN_COLLECTIVE_TIMEOUT="600")
    return env


def run_job(processes: int, mb: float, rounds: int, contenders: list[str], where: str | None,
            timeout: float) -> list[dict[str, Any]]:
    """One torchrun job of `processes` workers; returns each rank's result (rank order).

    Raises:
        RuntimeError: when the job fails or overruns `timeout` (it is killed, with every worker).
    """
    with tempfile.TemporaryDirectory(dir=where, prefix="fittrain-fsdp-ckpt-bench-") as tmp:
        out, root = pathlib.Path(tmp, "out"), pathlib.Path(tmp, "ckpt")
        out.mkdir()
        root.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                   "--master-port", str(_free_port()), os.path.abspath(__file__), "--worker", "--mb", str(mb),
                   "--rounds", str(rounds), "--root", str(root), "--out", str(out), "--contenders", *contenders]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_job_env(), start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise RuntimeError(f"{processes}-process job ({mb} MB) still running after {timeout:.0f} s; killed it. "
                               f"Pass a larger --timeout on a slow machine. Output:\n{output[-4000:]}") from None
        finally:
            if proc.poll() is None:  # interrupted: leave no worker behind
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode != 0:
            raise RuntimeError(f"{processes}-process job ({mb} MB) exited {proc.returncode}:\n{output[-6000:]}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per contender: medians over rounds of the slowest rank's time and the largest rank's extra peak."""
    summary: dict[str, Any] = {"shard_mb": max(r["shard_mb"] for r in ranks), "contenders": {},
                               "verified": all(all(r["verified"].values()) for r in ranks)}
    for name in ranks[0]["times"]:
        summary["contenders"][name] = {
            key: statistics.median(max(values) for values in zip(*(r["times"][name][key] for r in ranks)))
            for key in ("save_s", "load_s", "save_mb", "load_mb")}
    return summary


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "inf×"


def report(summaries: dict[int, dict[str, Any]], mb: float, rounds: int) -> str:
    """The contenders' markdown table for each process count, and the targets."""
    lines = [f"FSDP2 checkpoints, {mb:g} MB of parameters ({3 * mb:g} MB with AdamW's moments), gloo on the CPU, "
             f"medians of {rounds} alternating rounds (slowest rank's time, largest rank's extra peak RSS).", "",
             "| processes | contender | save s | load s | save extra MB/rank | load extra MB/rank | save ÷ full "
             "| load ÷ DCP's own |", "|---|---|---|---|---|---|---|---|"]
    for processes, summary in summaries.items():
        c = summary["contenders"]
        for name, m in c.items():
            lines.append(f"| {processes} | {name} | {m['save_s']:.3f} | {m['load_s']:.3f} | {m['save_mb']:.1f} | "
                         f"{m['load_mb']:.1f} | {_ratio(m['save_s'], c[FULL]['save_s'])} | "
                         f"{_ratio(m['load_s'], c[DCP]['load_s'])} |")
    lines += ["", "| processes | target | measured | met |", "|---|---|---|---|"]
    for processes, summary in summaries.items():
        lines += _target_rows(processes, summary)
    return "\n".join(lines)


def _target_rows(processes: int, summary: dict[str, Any]) -> list[str]:
    ours, full, dcp = (summary["contenders"][name] for name in (SHARDED, FULL, DCP))
    limit = TARGET_MEMORY_FACTOR * summary["shard_mb"] + TARGET_MEMORY_SLACK_MB
    peak = max(ours["save_mb"], ours["load_mb"])
    save, load = ours["save_s"] / full["save_s"], ours["load_s"] / dcp["load_s"]
    verdict = {True: "yes", False: "**no**"}
    return [
        f"| {processes} | sharded extra peak ≤ 1.2 × shard ({summary['shard_mb']:.1f} MB) + 50 MB = {limit:.1f} MB "
        f"| {peak:.1f} MB | {verdict[peak <= limit]} |",
        f"| {processes} | sharded save ≤ full save | {save:.2f}× | {verdict[save <= 1.0]} |",
        f"| {processes} | sharded load ≤ 1.1 × DCP's own load | {load:.2f}× | {verdict[load <= TARGET_LOAD_RATIO]} |",
        f"| {processes} | every load restored the saved shards | {summary['verified']} | "
        f"{verdict[summary['verified']]} |"]


def scaling_table(results: dict[tuple[float, int], dict[str, Any]], rounds: int) -> str:
    """Save/load time and extra peak RSS per rank, full against sharded, by model size and processes."""
    lines = [f"FSDP2 checkpoint time and per-rank memory, full vs sharded (gloo, CPU; medians of {rounds} alternating "
             "rounds; time of the slowest rank, extra peak RSS over the RSS before, largest rank).", "",
             "| params MB | processes | state MB/rank | save s full | save s sharded | sharded ÷ full | load s full "
             "| load s sharded | sharded ÷ full | save extra MB/rank full / sharded "
             "| load extra MB/rank full / sharded |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (mb, processes), summary in results.items():
        full, ours = summary["contenders"][FULL], summary["contenders"][SHARDED]
        lines.append(
            f"| {mb:g} | {processes} | {summary['shard_mb']:.1f} | {full['save_s']:.3f} | {ours['save_s']:.3f} | "
            f"{_ratio(ours['save_s'], full['save_s'])} | {full['load_s']:.3f} | {ours['load_s']:.3f} | "
            f"{_ratio(ours['load_s'], full['load_s'])} | {full['save_mb']:.0f} / {ours['save_mb']:.0f} | "
            f"{full['load_mb']:.0f} / {ours['load_mb']:.0f} |")
    if not all(summary["verified"] for summary in results.values()):
        lines.append("\n**A load did not restore the saved state** (see the warm-up check): the numbers are void.")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp", action="store_true", help="the contenders and targets at --mb (the default)")
    parser.add_argument("--fsdp-table", action="store_true", help="the scaling table: --sizes × --processes")
    parser.add_argument("--mb", type=float, default=32.0, help="MB of float32 parameters (state: 3×) for --fsdp")
    parser.add_argument("--sizes", type=float, nargs="+", default=[8.0, 32.0, 128.0],
                        help="MB of parameters for --fsdp-table")
    parser.add_argument("--processes", type=int, nargs="+", default=None,
                        help="process counts (default: 2 4 for --fsdp, 1 2 4 for --fsdp-table)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per job, after one warm-up round")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a job is killed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--contenders", nargs="+", default=[FULL, SHARDED, DCP], help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Runs the FSDP2 part of the checkpoint benchmark (or, with --worker, one process of it)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    if args.rounds < 1 or any(p < 1 for p in args.processes or [1]):
        parser.error(f"--rounds and --processes must be ≥ 1. Received: --rounds {args.rounds}, "
                     f"--processes {args.processes}.")
    if args.fsdp_table:
        processes = args.processes or [1, 2, 4]
        results = {(mb, n): summarise(run_job(n, mb, args.rounds, [FULL, SHARDED], args.dir, args.timeout))
                   for mb in args.sizes for n in processes}
        print(scaling_table(results, args.rounds))
    if args.fsdp or not args.fsdp_table:
        processes = args.processes or [2, 4]
        summaries = {n: summarise(run_job(n, args.mb, args.rounds, [FULL, SHARDED, DCP], args.dir, args.timeout))
                     for n in processes}
        print(report(summaries, args.mb, args.rounds))


if __name__ == "__main__":
    main()
