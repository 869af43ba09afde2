"""Stress: do 2-process Trainer runs exit 0, run after run, on a machine kept busy?

Each run is a real `torchrun --nproc-per-node 2` job (gloo, CPU) of this file in worker mode: a
`Trainer` with a `Checkpointer` and a validation loader, the shape of run that used to die at
interpreter exit now and then with "terminate called without an active exception" (SIGABRT, see
`fittrain.distributed.teardown`), after all its work was done. The script never calls `end_training()`, as
many user scripts don't. Beside the runs, `--load` CPU-bound processes keep the cores busy, which
is what made the crash show (about one run in four on a loaded 2-core machine).

Every run has a deadline; a run past it is killed with its whole process group and counts as a
failure. The last line reads `exit_stress: K/N runs exited 0`, and the exit code is 0 only when
all did.

Usage:
    python -m benchmarks.exit_stress                 # 20 runs beside 2 busy processes (3-6 minutes)
    python -m benchmarks.exit_stress --runs 3 --load 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

RUN_TIMEOUT_S = 180.0
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def worker(project: str) -> None:
    """One rank: two epochs with checkpoints and validation, then a plain end of script."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain import Trainer, TrainModule
    from fittrain.callbacks import Checkpointer

    class Net(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(96, 4)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    trainer = Trainer(max_epochs=2, project_dir=project, callbacks=[Checkpointer(every_n_steps=4, total_limit=2)])
    trainer.fit(Net(), DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=16))
    # No end_training(): the process must still exit cleanly on its own.


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _busy_cpus(count: int) -> Iterator[None]:
    """`count` CPU-bound processes for the duration of the block; always stopped afterwards."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _run_once(project: pathlib.Path) -> tuple[int, str]:
    """One 2-process job; returns its exit code (-9 when killed at the deadline) and its output."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FITTRAIN_COLLECTIVE_TIMEOUT="60")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(pathlib.Path(__file__).resolve()), "--worker", str(project)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -9, output + f"\n(killed after {RUN_TIMEOUT_S:.0f} s)"
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave no worker behind
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def _reason(output: str) -> str:
    for marker in ("terminate called", "SIGABRT", "EADDRINUSE", "Error", "killed after"):
        for line in output.splitlines():
            if marker in line:
                return line.strip()[:200]
    return output.strip().splitlines()[-1][:200] if output.strip() else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="how many 2-process jobs, one after another")
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes running beside them")
    parser.add_argument("--worker", metavar="PROJECT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    passed = 0
    with _busy_cpus(args.load), tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            started = time.monotonic()
            code, output = _run_once(pathlib.Path(tmp) / f"run{i}")
            passed += code == 0
            verdict = "ok" if code == 0 else f"exit {code}: {_reason(output)}"
            print(f"run {i + 1:>2}/{args.runs}: {time.monotonic() - started:5.1f} s  {verdict}", flush=True)
    print(f"exit_stress: {passed}/{args.runs} runs exited 0 (beside {args.load} busy processes)")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
