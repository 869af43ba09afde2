"""FSDP2 with a stateless optimizer (plain SGD): save_state, change the lr, load_state restores it.

torch's sharded optimizer loader cannot place an empty state, so such checkpoints once failed to
load under FSDP2 ("Expected device to be set"). Writes rank{r}.pt with the lr and the weights.
"""

import sys

import torch
from torch import nn

from fittrain import Accelerator

out = sys.argv[1]
acc = Accelerator(strategy="fsdp", project_dir=out)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = acc.prepare(model, optimizer)
acc.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
optimizer.zero_grad()
acc.save_state(f"{out}/checkpoint")
saved = acc.get_state_dict(model)
optimizer.param_groups[0]["lr"] = 0.5
acc.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
acc.load_state(f"{out}/checkpoint")
torch.save({"lr": optimizer.param_groups[0]["lr"], "restored": acc.get_state_dict(model), "saved": saved},
           f"{out}/rank{acc.process_index}.pt")
acc.end_training()
