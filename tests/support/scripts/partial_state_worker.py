"""`PartialState`, `fittrain.utils`' collectives, the Accelerator's decorators and triggers, on N processes.

Each rank writes what it saw to `{out}/rank{r}.json`; the test compares the ranks.
"""

import json
import sys

import torch

from fittrain import Accelerator, PartialState
from fittrain.utils import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)

out = sys.argv[1]
state = PartialState()
acc = Accelerator()
rank = state.process_index
ran = []


@acc.on_main_process
def on_main():
    ran.append("main")


@acc.on_last_process
def on_last():
    ran.append("last")


@state.on_process(process_index=1)
def on_one():
    ran.append("one")


@acc.on_local_main_process
def on_local_main():
    ran.append("local_main")


def _pad_error() -> str:
    """Tensors whose other dimensions differ cannot be padded into one shape: an error on every rank
    (without debug mode too), not a silent mismatch or a hang."""
    try:
        pad_across_processes(torch.ones(1, 2 + rank))
    except DistributedOperationException as error:
        return str(error).splitlines()[0]
    return "no error"


for fn in (on_main, on_last, on_one, on_local_main):
    fn()
if rank == 1:
    acc.set_trigger()
first_check = acc.check_trigger()
second_check = acc.check_trigger()  # the flags were reset by the first check
value = torch.tensor([float(rank + 1), float(10 - rank)])
facts = {
    "agree": [state.num_processes == acc.num_processes, state.process_index == acc.process_index,
              str(state.device) == str(acc.device), state.distributed_type.value == acc.distributed_type.value],
    "is_last": state.is_last_process,
    "ran": ran,
    "triggers": [first_check, second_check],
    "gather": gather(torch.tensor([rank])).tolist(),
    "gather_object": gather_object([f"r{rank}"]),
    "reduce_mean": reduce(value).tolist(),
    "reduce_max": acc.reduce(value, reduction="max").tolist(),
    "reduce_min": reduce(value, reduction="min").tolist(),
    "broadcast": broadcast(torch.tensor([rank + 5]), from_process=1).tolist(),
    "object_list": broadcast_object_list([{"rank": rank}]),
    "padded": pad_across_processes(torch.ones(rank + 1)).tolist(),
    "pad_mismatch": _pad_error(),
}
with open(f"{out}/rank{rank}.json", "w") as handle:
    json.dump(facts, handle)
acc.end_training()
