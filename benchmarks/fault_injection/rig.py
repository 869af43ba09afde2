"""The in-process rig of the worker and writer roles: an Accelerator with something of every kind to save.

Its `_Tag` records which writer saved which save, and a fingerprint of the weights it saved, so a
checkpoint can be traced to the save that wrote it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
from torch import nn

from fittrain import Accelerator
from fittrain.checkpoint import ProjectConfiguration


def fingerprint(state: dict[str, torch.Tensor]) -> float:
    """The sum of all the values in `state`: equal for weights saved and loaded unchanged."""
    return float(sum(float(v.double().sum()) for _, v in sorted(state.items())))


class _Tag:
    """A registered object: which writer saved, which save, and a fingerprint of the weights saved."""

    def __init__(self, writer: int, model: nn.Module) -> None:
        self.writer, self.save, self.model, self.fingerprint = writer, 0, model, 0.0

    def state_dict(self) -> dict[str, Any]:
        self.fingerprint = fingerprint(self.model.state_dict())
        return {"writer": self.writer, "save": self.save, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.writer, self.save = state["writer"], state["save"]


class Rig:
    """An Accelerator on the CPU with a linear model, SGD, a scheduler and a `_Tag`.

    With `auto`, save_state() names folders `checkpoint_N` itself (and ignores the folder it is given).
    """

    def __init__(self, project: pathlib.Path, seed: int, width: int = 16, writer: int = 0, auto: bool = True) -> None:
        torch.manual_seed(seed)
        model = nn.Linear(width, width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        self.acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            os.fspath(project), automatic_checkpoint_naming=auto))
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.tag = _Tag(writer, self.model)
        self.acc.register_for_checkpointing(self.tag)
        self.width = width

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.acc.backward(self.model(torch.randn(4, self.width)).square().mean())
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of everything a load restores: weights, momentum, scheduler step, RNG, tag."""
        state = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, entry in self.opt.state_dict()["state"].items():
            state.update({f"optimizer.{i}.{k}": v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)})
        state["scheduler"] = torch.tensor(self.sched.state_dict()["last_epoch"])
        state["rng"] = torch.get_rng_state()
        state["tag"] = torch.tensor(self.tag.save)
        return state
