"""A 2-process job that goes wrong on purpose: `fail_worker.py raise|stall|uneven`.

raise: rank 1 prints the time and raises while rank 0 waits in a barrier that can never
    complete. The launcher must end the job with rank 1's exit code instead of leaving rank 0
    waiting.
stall: rank 1 stays alive but never joins rank 0's all-reduce. Rank 0's collective must fail
    after FITTRAIN_COLLECTIVE_TIMEOUT; it reports how long it waited and exits 7.
stall_kwargs: the same, with the timeout (3 s) from Accelerate's InitProcessGroupKwargs instead.
uneven: each rank passes a dataset of another length, to `prepare` and then (as a list of
    batches) to `Trainer.fit`. Both must fail at once on every rank, naming both lengths, instead
    of hanging in the first collective the shorter rank never reaches; the worker prints each
    error and exits 0, and (every mode) which gloo threads are left when the interpreter finalizes.
    Exiting 0 matters: torchrun SIGTERMs the other rank as soon as one fails, which would cut
    that rank's finalization (and its report) short.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import pathlib
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, Trainer, TrainModule
from fittrain.utils import InitProcessGroupKwargs

STALL_EXIT_CODE = 7


class _Regressor(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gloo_threads() -> list[str]:
    """gloo's native threads still running (Linux: /proc/self/task), or ["unknown"] elsewhere."""
    tasks = pathlib.Path("/proc/self/task")
    if not tasks.is_dir():
        return ["unknown"]
    names = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sorted(name for name in names if "gloo" in name)


def uneven(accelerator: Accelerator) -> int:
    """Rank r brings 16 - 4r samples: a user error that must be named, not hang."""
    n = 16 - 4 * accelerator.process_index
    for name, attempt in (
            ("prepare", lambda: accelerator.prepare(DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=4))),
            ("fit", lambda: Trainer(accelerator=accelerator).fit(_Regressor(), list(torch.randn(n // 4, 4, 2))))):
        try:
            attempt()
        except ValueError as error:
            print(f"rank {accelerator.process_index} {name}: {error}", flush=True)
        else:
            print(f"rank {accelerator.process_index} {name}: no error", flush=True)
    return 0


def main(mode: str) -> int:
    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=3))] if mode == "stall_kwargs" else None
    accelerator = Accelerator(kwargs_handlers=handlers)
    if mode == "uneven":
        return uneven(accelerator)
    if mode == "raise":
        if accelerator.process_index == 1:
            time.sleep(1.0)  # let rank 0 settle into the barrier first
            print(f"rank 1 raises at {time.time():.3f}", flush=True)
            raise RuntimeError("rank 1 fails on purpose")
        accelerator.wait_for_everyone()
        print("rank 0 passed a barrier that rank 1 never reached", flush=True)
        return 0
    if accelerator.process_index == 1:
        time.sleep(600)  # alive, but absent from the collective; the launcher stops us
        return 0
    started = time.monotonic()
    try:
        accelerator.reduce(torch.ones(1))
    except RuntimeError as error:
        print(f"collective failed after {time.monotonic() - started:.1f}s, at {time.time():.3f}: {error}",
              flush=True)
        return STALL_EXIT_CODE
    print("the collective completed without rank 1", flush=True)
    return 0


if __name__ == "__main__":
    # Registered before fittrain's own handler, so it runs after it, as the interpreter starts to
    # finalize: gloo's threads must be gone by then, or one finishing the last collective can abort
    # the exit (DDP's constructor imports torch._dynamo, which keeps a group it finds alive).
    atexit.register(lambda: print(f"at exit: gloo_threads={gloo_threads()}", flush=True))
    sys.exit(main(sys.argv[1]))
