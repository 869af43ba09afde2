"""A 2-process script that ends without `end_training()`, with an async checkpoint still in flight.

`exit_worker.py PROJECT`: each rank trains a few DDP steps, starts `save_state(async_save=True)`
and simply ends. A handler registered before fittrain's own (so it runs after them) reports what
the interpreter is left with when it starts to finalize: whether the process groups are gone and
which threads still run. The test expects no group and no fittrain thread, and a checkpoint that
landed whole.
"""

from __future__ import annotations

import atexit
import sys
import threading

import torch
import torch.distributed as dist


def report() -> None:
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    print(f"at exit: rank {rank[0]} group_alive={dist.is_initialized()} threads={threads}", flush=True)


rank = [None]
atexit.register(report)  # first registered, so it runs last

from fittrain import Accelerator, ProjectConfiguration  # noqa: E402  (after the handler, on purpose)

accelerator = Accelerator(project_config=ProjectConfiguration(sys.argv[1], automatic_checkpoint_naming=True))
rank[0] = accelerator.process_index
model = torch.nn.Linear(8, 8)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(3):
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {rank[0]} saving {accelerator.save_state(async_save=True)}", flush=True)
