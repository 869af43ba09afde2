"""The rig of the sharded roles: one rank's FSDP2 Accelerator with something of every kind to save.

Each rank of a 2-process gloo job (CPU) builds it: an MLP sharded with FSDP2, AdamW in one or two
parameter groups, a scheduler, a prepared loader read mid-epoch and a step counter, with
`state_dict_type="sharded"` (FSDP2's default), so a save writes ``shards/__{rank}_0.distcp``,
``shards/metadata.json``, ``shards/values.pt`` and ``data_states_{rank}.pt``. `snapshot` copies
everything of this rank that a load restores, so two snapshots compare bitwise.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator
from fittrain.checkpoint import ProjectConfiguration

WIDTH = 64
#: Samples of the loader: 8 batches of 4 per rank and epoch on 2 ranks.
SAMPLES = 64


class Counter:
    """The steps trained, registered for checkpointing: names the record of the state saved at a step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of `value` (a DTensor's local shard), copied."""
    return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()


def _as_tensor(obj: Any) -> torch.Tensor:
    """`obj` (plain data) as bytes in a tensor, so that `differing` compares it like the tensors."""
    text = json.dumps(obj, sort_keys=True, default=lambda v: v.tolist() if isinstance(v, torch.Tensor) else repr(v))
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


class ShardedRig:
    """One rank's Accelerator (strategy "fsdp", sharded checkpoints) with model, AdamW, scheduler,
    a prepared loader and a `Counter`.

    Args:
        project: The project folder; save_state() names folders `checkpoints/checkpoint_N` itself.
        seed: Seeds the weights and the data order: rigs seeded differently differ everywhere.
        groups: AdamW's parameter groups: 1, or 2 (weights and biases, with different learning rates).
        limit: ProjectConfiguration(total_limit=...).
        width: The hidden layers' width (wider: longer saves, for kills to land in).
    """

    def __init__(self, project: pathlib.Path, seed: int, groups: int = 1, limit: int | None = None,
                 width: int = WIDTH) -> None:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        params = ([{"params": weights}, {"params": biases, "lr": 3e-3}] if groups == 2 else model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(SAMPLES, 8, generator=g)
        loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True)
        self.acc = Accelerator(strategy="fsdp", state_dict_type="sharded", project_config=ProjectConfiguration(
            os.fspath(project), automatic_checkpoint_naming=True, total_limit=limit))
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, opt, sched, loader)
        self.counter = Counter()
        self.acc.register_for_checkpointing(self.counter)
        self._batches = iter(self.loader)

    def step(self, n: int = 1) -> None:
        """Trains `n` steps on the loader's next batches (a new epoch when one ends)."""
        for _ in range(n):
            batch = next(self._batches, None)
            if batch is None:
                self._batches = iter(self.loader)
                batch = next(self._batches)
            x, y = batch
            self.acc.backward(nn.functional.mse_loss(self.model(x), y))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.counter.step += 1

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's part of everything a load restores: weights, optimizer state and
        groups, scheduler, loader position, RNG, step counter."""
        state = {f"model.{k}": _local(v) for k, v in self.model.state_dict().items()}
        opt = self.opt.state_dict()
        for i, entry in opt["state"].items():
            state.update({f"optimizer.{i}.{k}": _local(v) for k, v in entry.items() if isinstance(v, torch.Tensor)})
        state["optimizer.param_groups"] = _as_tensor(opt["param_groups"])
        state["scheduler"] = _as_tensor(self.sched.state_dict())
        state["loader"] = _as_tensor(self.loader.state_dict())
        state["rng"] = torch.get_rng_state()
        state["counter"] = torch.tensor(self.counter.step)
        return state
