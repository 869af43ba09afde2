"""notebook_launcher and debug_launcher, called from a plain Python process (as a notebook would).

`launchers_worker.py OUT`: each launcher runs `report` on 2 processes; every rank writes what its
Accelerator saw (rank, world size, precision, a sum over the ranks) to OUT/{launcher}_rank{r}.json.
"""

import json
import sys

import torch

from fittrain import Accelerator, debug_launcher, notebook_launcher


def report(out: str, name: str) -> None:
    acc = Accelerator()
    total = acc.reduce(torch.tensor([acc.process_index + 1.0]), reduction="sum").item()
    with open(f"{out}/{name}_rank{acc.process_index}.json", "w") as handle:
        json.dump({"processes": acc.num_processes, "precision": acc.mixed_precision, "sum": total,
                   "device": str(acc.device)}, handle)
    acc.end_training()


if __name__ == "__main__":
    out, port = sys.argv[1], sys.argv[2]
    notebook_launcher(report, args=(out, "notebook"), num_processes=2, mixed_precision="bf16", use_port=port)
    debug_launcher(report, args=(out, "debug"), num_processes=2)
