"""One process of a multi-process FSDP2 job: training, saving and checkpoint round trips.

Run under torchrun: `fsdp_worker.py --out DIR`. Each rank saves its facts to DIR/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import training
from fittrain import Accelerator
from fittrain.distributed import parallel


def _grads_present(log: list[tuple[int, bool, bool]]) -> Any:
    def record(model: nn.Module, batch: int, sync: bool) -> None:
        log.append((batch, sync, any(p.grad is not None for p in model.parameters())))

    return record


def fsdp_runs(out: pathlib.Path) -> dict[str, Any]:
    """training.RUNS under FSDP2, recording when sharded gradients (a reduce-scatter) appeared."""
    results = {}
    for name, (batch, n, accumulation) in training.RUNS.items():
        acc = Accelerator(strategy="fsdp", gradient_accumulation_steps=accumulation)
        log: list[tuple[int, bool, bool]] = []
        params = training.train(acc, batch, n, after_backward=_grads_present(log))
        results[name] = {"params": params, "grads": log}
    return results


def prepared(acc: Accelerator) -> tuple[nn.Module, Any, Any]:
    model = training.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=training.LR, momentum=training.MOMENTUM)
    return acc.prepare(model, optimizer, training.make_loader(32, 4))


def train_epoch(acc: Accelerator, model: nn.Module, optimizer: Any, loader: Any) -> dict[str, torch.Tensor]:
    for x, y in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def rebinding(out: pathlib.Path) -> dict[str, Any]:
    """The optimizer built before prepare() holds exactly the sharded parameters afterwards."""
    acc = Accelerator(strategy="fsdp")
    model, optimizer, _ = prepared(acc)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "is_fsdp": parallel.is_fsdp(model), "unwrapped_is_model": acc.unwrap_model(model) is model,
        "distributed_type": str(acc.distributed_type.value),
        "same_objects": len(held) == len(list(model.parameters()))
        and all(a is b for a, b in zip(held, model.parameters())),
        "all_dtensor": all(type(p).__name__ == "DTensor" for p in held),
        "fsdp_units": sum(parallel.is_fsdp(m) for m in model.modules()),
    }


def rebinding_later(out: pathlib.Path) -> dict[str, Any]:
    """An optimizer built on the plain model but prepared in a later prepare() call is re-bound
    too, and training then moves the sharded parameters."""
    acc = Accelerator(strategy="fsdp")
    model = training.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=training.LR)
    model = acc.prepare(model)
    optimizer = acc.prepare(optimizer)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    before = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    x = torch.randn(4, training.N_FEATURES)
    acc.backward(model(x).pow(2).mean())
    optimizer.step()
    after = acc.get_state_dict(model)
    return {"same_objects": len(held) == len(list(model.parameters()))
            and all(a is b for a, b in zip(held, model.parameters())),
            "moved": acc.process_index != 0 or all(not torch.equal(before[k], after[k]) for k in before)}


def save_model(out: pathlib.Path) -> dict[str, Any]:
    """save_model under FSDP2 writes full weights from the main process."""
    acc = Accelerator(strategy="fsdp")
    model, optimizer, loader = prepared(acc)
    params = train_epoch(acc, model, optimizer, loader)
    acc.save_model(model, out / "saved")
    return {"params": params}


def optimizer_helpers(out: pathlib.Path) -> dict[str, Any]:
    """The strategy's full model/optimizer state methods round-trip through files, bit for bit."""
    acc = Accelerator(strategy="fsdp")
    model, optimizer, loader = prepared(acc)
    train_epoch(acc, model, optimizer, loader)
    strategy = acc.distributed_strategy
    model_state = strategy.full_state_dict(model)
    optimizer_state = strategy.optimizer_state_dict(optimizer, [model])
    position = loader.state_dict()
    if acc.is_main_process:
        torch.save({"model": model_state, "optimizer": optimizer_state}, out / "full_state.pt")
    acc.wait_for_everyone()
    first = train_epoch(acc, model, optimizer, loader)
    # Every rank reads the full state, as load_state does, and keeps its own shard of it.
    full = torch.load(out / "full_state.pt", weights_only=True)
    strategy.load_full_state_dict(model, full["model"])
    strategy.load_optimizer_state_dict(optimizer, [model], full["optimizer"])
    loader.load_state_dict(position)
    second = train_epoch(acc, model, optimizer, loader)
    return {"first": first, "second": second, "saved_keys": sorted(optimizer_state.get("state", {}))}


def accelerator_state(out: pathlib.Path) -> dict[str, Any]:
    """Accelerator.save_state/load_state under FSDP2 round-trip, bit for bit (or the error)."""
    acc = Accelerator(strategy="fsdp")
    model, optimizer, loader = prepared(acc)
    train_epoch(acc, model, optimizer, loader)
    try:
        folder = acc.save_state(out / "ckpt")
        first = train_epoch(acc, model, optimizer, loader)
        acc.load_state(folder)
        second = train_epoch(acc, model, optimizer, loader)
    except Exception as error:  # reported to the test, which shows it
        # Ranks may now be out of step; leave without further collectives.
        return {"error": f"{type(error).__name__}: {error}"}
    return {"first": first, "second": second}


SCENARIOS = {"rebinding": rebinding, "rebinding_later": rebinding_later, "fsdp_runs": fsdp_runs,
             "save_model": save_model,
             "optimizer_helpers": optimizer_helpers, "accelerator_state": accelerator_state}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in args.scenarios.split(","):
        started = time.perf_counter()
        results[name] = SCENARIOS[name](args.out)
        results[f"{name}_seconds"] = time.perf_counter() - started
    torch.save(results, args.out / f"rank{os.environ['RANK']}.pt")
    if "error" not in results.get("accelerator_state", {}):
        Accelerator().end_training()


if __name__ == "__main__":
    sys.exit(main())
