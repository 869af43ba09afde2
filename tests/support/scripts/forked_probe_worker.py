"""What a forked rank sees (tests/support/ranks.py), for test_forked_ranks.py: `forked_probe_worker.py OUT MODE`.

MODE "probe" writes OUT/rank{r}.pt with the rank's view of its process and joins a gloo group;
"raise" makes rank 1 raise while rank 0 waits in a barrier; "hang" waits forever.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import random
import sys
import threading

import torch
import torch.distributed as dist

out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "hang":
    threading.Event().wait()  # forever: only the runner's deadline ends this job
dist.init_process_group("gloo")
if mode == "raise":
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # never passes: rank 1 is gone, and the runner ends this rank
facts = torch.tensor([rank + 1.0])
dist.all_reduce(facts)
torch.save({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "threads": torch.get_num_threads(),
            "world": dist.get_world_size(), "sum": facts.item(), "start_method": multiprocessing.get_start_method(),
            "random": random.random(), "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}},
           out / f"rank{rank}.pt")
print(f"rank {rank} done")
dist.destroy_process_group()
