"""One process of a 4-process HSDP job (`ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`).

Run as `hsdp_worker.py --out DIR` on 4 ranks; each rank saves what it saw to DIR/rank{r}.pt:

- train: training.RUNS' "plain" run under HSDP, its full parameters (on rank 0), and the mesh
  the model was sharded on;
- resume: an epoch, a save (sharded, the default under FSDP2), the next epoch; then the
  checkpoint loaded back and that epoch again, which must be bitwise the same;
- as_fsdp: the HSDP checkpoint loaded under plain FSDP2 over all 4 processes (another layout);
- trainer: `Trainer(parallelism_config=...)` fits under the same layout;
- memory: the bytes this rank holds after an AdamW step under HSDP and under FSDP2 over all 4,
  for `fittrain.distributed.memory_estimate` to be compared with.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import training
from fittrain import Accelerator, ParallelismConfig, Trainer, TrainModule
from fsdp_worker import prepared, train_epoch

HSDP = dict(dp_replicate_size=2, dp_shard_size=2)


def _state(acc: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def train(out: pathlib.Path) -> dict[str, Any]:
    acc = Accelerator(parallelism_config=ParallelismConfig(**HSDP))
    mesh: dict[str, Any] = {}

    def record(model: nn.Module, _: Any) -> None:
        weight = next(model.parameters())
        mesh.update(shape=tuple(weight.device_mesh.shape), names=weight.device_mesh.mesh_dim_names,
                    placements=[type(p).__name__ for p in weight.placements])

    batch, n, _ = training.RUNS["plain"]
    params = training.train(acc, batch, n, on_prepared=record)
    return {"params": params, "mesh": mesh, "strategy": acc.strategy, "distributed_type": acc.distributed_type.value}


def resume(out: pathlib.Path) -> dict[str, Any]:
    acc = Accelerator(parallelism_config=ParallelismConfig(**HSDP))
    model, optimizer, loader = prepared(acc)
    train_epoch(acc, model, optimizer, loader)
    saved = _state(acc, model)
    folder = acc.save_state(out / "hsdp_checkpoint")
    first = train_epoch(acc, model, optimizer, loader)
    acc.load_state(folder)
    second = train_epoch(acc, model, optimizer, loader)
    return {"saved": saved, "first": first, "second": second}


def as_fsdp(out: pathlib.Path) -> dict[str, Any]:
    acc = Accelerator(strategy="fsdp")
    model, optimizer, loader = prepared(acc)
    acc.load_state(out / "hsdp_checkpoint")
    loaded = _state(acc, model)
    return {"loaded": loaded, "after_epoch": train_epoch(acc, model, optimizer, loader)}


class _Regression(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = training.make_model()

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=training.LR)


def trainer(out: pathlib.Path) -> dict[str, Any]:
    fit = Trainer(parallelism_config=ParallelismConfig(**HSDP), max_epochs=1, project_dir=out / "trainer",
                  enable_progress_bar=False)
    fit.fit(_Regression(), training.make_loader(32, 4))
    strategy = fit.accelerator.distributed_strategy
    return {"mesh": (strategy.mesh_shape, strategy.mesh_dim_names), "loss": float(fit.state.loss),
            "steps": fit.state.global_step}


def memory(out: pathlib.Path) -> dict[str, Any]:
    held = {}
    layouts = (("hsdp", dict(parallelism_config=ParallelismConfig(**HSDP))), ("fsdp", dict(strategy="fsdp")))
    for name, options in layouts:
        acc = Accelerator(**options)
        model = training.make_model()
        model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=training.LR))
        x, y = next(iter(training.make_loader(32, 4)))
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        held[name] = training.held_bytes(model, optimizer)
    return held


SCENARIOS = {"train": train, "resume": resume, "as_fsdp": as_fsdp, "trainer": trainer, "memory": memory}


if __name__ == "__main__":
    sys.exit(training.run_scenarios(SCENARIOS))
