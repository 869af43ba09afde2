"""2 ranks: rank 0 leaves its process group while a collective is in flight, its DDP model garbage.

This is how a Trainer script ends: the model (a DDP with its native `Reducer`) is only reachable
from a reference cycle, and the last collective's tensors are dropped by gloo's worker thread
after Python dropped them. Rank 1 joins the all-reduce late, so that rank 0's worker thread is
still in it when rank 0 calls `leave_process_group` (what `end_training` and fittrain's atexit
handler call). Destroying the group from `gc` (through the Reducer) while holding the GIL
deadlocked there: the worker, done with the all-reduce, waits for the GIL to free the tensor
while holding the lock the group's destructor waits for. Each rank prints "left" when it is out.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fittrain import Accelerator
from fittrain.distributed.teardown import leave_process_group

#: How long rank 1 keeps rank 0's all-reduce in flight; long enough for rank 0 to reach the teardown.
LATE_BY = 2.0


def start_and_drop() -> None:
    """Prepares a DDP model kept only by a reference cycle, starts an all-reduce, drops every handle."""
    accelerator = Accelerator()
    cycle: dict = {"model": accelerator.prepare(torch.nn.Linear(2, 2))}
    cycle["self"] = cycle  # only `gc` frees the model, as it frees a Trainer's
    if accelerator.process_index == 1:
        time.sleep(LATE_BY)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if accelerator.process_index == 1:
        work.wait()
    # Rank 0 returns with the all-reduce in flight: only gloo's worker thread holds its tensor now.


if __name__ == "__main__":
    start_and_drop()
    leave_process_group()
    print(f"left: initialized={dist.is_initialized()}", flush=True)
