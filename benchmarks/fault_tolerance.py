"""Fault tolerance: how long a job takes to train again after a failure, and how many steps it loses.

Each scenario starts a real job with `fittrain launch` on this machine (2 processes, gloo), a
small MLP trained by the Trainer with a checkpoint every `--every` optimizer steps and
`resume_from="auto"`, and injects one failure once the job has passed `--kill-at` steps:

- **worker**: SIGKILL one of 2 workers of one launcher (`--max_restarts 1`): torchrun restarts both.
- **worker2**: the same in an elastic job of two launchers with one worker each
  (`--nnodes 1:2`, c10d rendezvous on localhost): both launchers restart theirs and meet again.
- **launcher**: SIGKILL the second launcher of that elastic job (a machine lost): the first goes on
  alone, from the newest checkpoint, on one process (after the rendezvous' `last_call_timeout`,
  `--last-call` seconds, of waiting for company).
- **stopped**: rank 1 stops itself (SIGSTOP): the hang watchdog of rank 0 ends the job
  (`Trainer(hang_timeout=...)`, `--hang-timeout`, default "auto": max(60 s, 20 x the median step))
  and torchrun restarts it.

Every rank appends (restart count, optimizer step, time) to a file after each step. The table
gives, per scenario, the seconds from the failure (the kill, or the moment rank 1 stopped) to the
first optimizer step after the restart, and the steps lost: those trained since the checkpoint the
run resumed from, which it trains again (at most `--every` minus one). Recovery time is mostly
detecting the failure, starting Python and torch again, the rendezvous and the checkpoint load.

Usage:
    python -m benchmarks.fault_tolerance                       # every scenario, about 2.5 minutes
    python -m benchmarks.fault_tolerance --scenarios worker    # one scenario
    python -m benchmarks.fault_tolerance --hang-timeout 5      # a shorter hang bound
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Scenario ids (for --scenarios) and what the table calls them.
SCENARIOS = {"worker": "worker killed", "worker2": "worker killed, 2 launchers",
             "launcher": "launcher killed (1 of 2)", "stopped": "rank stopped (SIGSTOP)"}
DEADLINE_S = 300.0


# --------------------------------------------------------------------------- the job's worker
def worker(args: argparse.Namespace) -> None:
    """One rank of the job: the Trainer on a small MLP, recording every step (runs under torchrun)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain import Callback, Trainer, TrainModule
    from fittrain.callbacks import Checkpointer

    class Net(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

        def training_step(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    project = pathlib.Path(args.project)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class Record(Callback):
        """Appends "attempt step time" after every optimizer step; rank 1 may stop itself first."""

        def __init__(self) -> None:
            self.file = open(project / f"steps.rank{rank}.attempt{attempt}", "a", buffering=1)  # noqa: SIM115

        def on_train_batch_start(self, trainer: Trainer) -> None:
            stop = project / "stop_at"
            if rank == 1 and stop.exists() and trainer.state.global_step >= int(stop.read_text()):
                stop.unlink()
                (project / "stopped").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)

        def on_train_batch_end(self, trainer: Trainer) -> None:
            self.file.write(f"{attempt} {trainer.state.global_step} {time.time()}\n")

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=generator)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True)
    hang_timeout: Any = "auto" if args.hang_timeout == "auto" else float(args.hang_timeout)
    trainer = Trainer(callbacks=[Checkpointer(every_n_steps=args.every), Record()], max_steps=args.steps,
                      project_dir=project, resume_from="auto", enable_progress_bar=False, hang_timeout=hang_timeout)
    trainer.fit(Net(), loader)


# --------------------------------------------------------------------------- the controller
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _steps(project: pathlib.Path) -> list[tuple[int, int, float]]:
    """Every (attempt, step, time) any rank recorded, in time order."""
    records = []
    for path in project.glob("steps.rank*.attempt*"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                records.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return sorted(records, key=lambda record: record[2])


def _launch(args: argparse.Namespace, project: pathlib.Path, elastic_port: int | None) -> list[str]:
    launch = [sys.executable, "-m", "fittrain", "launch", "--max_restarts", "1", "--monitor_interval", "0.5"]
    if elastic_port is None:
        launch += ["--num_processes", "2"]
    else:
        launch += ["--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                   f"127.0.0.1:{elastic_port}", "--rdzv_id", "fault-tolerance",
                   "--rdzv_conf", f"last_call_timeout={args.last_call},join_timeout=120"]
    return [*launch, "-m", "benchmarks.fault_tolerance", "--worker", "--project", str(project),
            "--steps", str(args.steps), "--every", str(args.every), "--hang-timeout", args.hang_timeout]


def _start(command: list[str], log: pathlib.Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_until(condition: Any, what: str, jobs: list[subprocess.Popen], log: pathlib.Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if any(job.poll() is not None for job in jobs) or time.monotonic() > deadline:
            raise RuntimeError(f"fault_tolerance: the job ended or stalled before {what}. Its log:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.05)


def run_scenario(name: str, args: argparse.Namespace, root: pathlib.Path) -> dict[str, float]:
    """Runs one scenario; returns the seconds to the first step after the restart and the steps lost."""
    project = root / name
    project.mkdir()
    log = project / "job.log"
    elastic = name in ("worker2", "launcher")
    port = _free_port() if elastic else None
    jobs = [_start(_launch(args, project, port), log)]
    try:
        if elastic:  # the second launcher joins once the first hosts the rendezvous store
            _wait_until(lambda: _listening(port), "the rendezvous store listened", jobs, log)
            jobs.append(_start(_launch(args, project, port), project / "job2.log"))
        if name == "stopped":
            (project / "stop_at").write_text(str(args.kill_at))
        _wait_until(lambda: any(step >= args.kill_at for _, step, _ in _steps(project)),
                    f"step {args.kill_at}", jobs, log)
        if name == "launcher":
            failed_at = time.time()
            os.kill(jobs[1].pid, signal.SIGKILL)  # the second launcher; its worker dies with it
        elif name != "stopped":
            pids = _worker_pids(jobs[-1].pid)
            failed_at = time.time()
            os.kill(pids[-1], signal.SIGKILL)
        _wait_until(lambda: any(attempt > 0 for attempt, _, _ in _steps(project)),
                    "the first step after the restart", jobs[:1], log)
        if name == "stopped":
            failed_at = float((project / "stopped").read_text())
        records = _steps(project)
        first_after = next((step, t) for attempt, step, t in records if attempt > 0)
        resumed_from = first_after[0] - 1
        # The last step the first attempt finished, even if its record came just after the kill: on a
        # busy machine a step (and the checkpoint after it) can complete while the signal is delivered,
        # and a step's checkpoint can be written before its record is (the Checkpointer's hook runs
        # before Record's), so the checkpoint resumed from bounds it too: then nothing was lost.
        last_before = max(resumed_from, *(step for attempt, step, _ in records if attempt == 0))
        jobs[0].wait(timeout=DEADLINE_S)
        return {"recovery": first_after[1] - failed_at, "lost": last_before - resumed_from, "at": last_before}
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()


def _worker_pids(launcher: int) -> list[int]:
    """The launcher's worker processes (its children), oldest first."""
    children = pathlib.Path(f"/proc/{launcher}/task/{launcher}/children")
    return sorted(int(pid) for pid in children.read_text().split())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, from: {','.join(SCENARIOS)} (default: all)")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each job (default 600)")
    parser.add_argument("--every", type=int, default=50, help="a checkpoint every N steps (default 50)")
    parser.add_argument("--kill-at", type=int, default=320, help="fail once the job passed this step (default 320)")
    parser.add_argument("--hang-timeout", default="auto", help="Trainer(hang_timeout=...) (default: auto)")
    parser.add_argument("--last-call", type=float, default=10, help="rendezvous last_call_timeout s (default 10)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--project", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.error(f"--scenarios takes names from: {','.join(SCENARIOS)}. Received: --scenarios {args.scenarios!r}.")
    if not 0 < args.every < args.kill_at < args.steps:
        parser.error(f"need 0 < --every < --kill-at < --steps. Received: --every {args.every} --kill-at "
                     f"{args.kill_at} --steps {args.steps}.")
    results = {}
    with tempfile.TemporaryDirectory(prefix="fittrain-fault-tolerance-") as root:
        for name in names:
            print(f"fault_tolerance: {name} ...", file=sys.stderr, flush=True)
            results[name] = run_scenario(name, args, pathlib.Path(root))
    print(f"\n2 processes (gloo, CPU), a checkpoint every {args.every} steps, failure after step {args.kill_at}, "
          f"hang_timeout={args.hang_timeout}, last_call_timeout={args.last_call:g} s.\n")
    print("| scenario | failed after step | seconds to the first step after restart | steps lost (trained again) "
          "| lost ÷ checkpoint interval |")
    print("|---|---:|---:|---:|---:|")
    for name, result in results.items():
        print(f"| {SCENARIOS[name]} | {result['at']} | {result['recovery']:.1f} | {result['lost']} "
              f"| {result['lost'] / args.every:.2f}× |")
    print(json.dumps({"fault_tolerance": results}), file=sys.stderr)


if __name__ == "__main__":
    main()
