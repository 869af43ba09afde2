"""One process of an FSDP2 job that tries damaged and mismatching sharded checkpoints (issue 23).

Run under torchrun: `sharded_strict_worker.py --out DIR`. A small MLP with AdamW, a StepLR
schedule and a prepared loader of 8 batches per process saves checkpoint_0 and checkpoint_1
(automatic naming, state_dict_type="sharded"). Rank 0 then writes damaged copies of checkpoint_1
(each file rewritten with a matching manifest entry, as an attacker who knows the format would),
and every rank tries to load each into a run that has trained a step, which must refuse it and
stay as it was. Then: a run with two parameter groups; a fresh run (no optimizer state may be
left behind); and load_state() with checkpoint_1 damaged in place, which must load checkpoint_0.
Writes what each attempt raised and whether anything changed to DIR/strict{rank}.json.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import shutil
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, ProjectConfiguration
from fittrain.checkpoint.crc import file_checksum


def build(out: pathlib.Path, groups: int = 1) -> dict[str, Any]:
    project = ProjectConfiguration(out / "project", automatic_checkpoint_naming=True)
    accelerator = Accelerator(strategy="fsdp", project_config=project, state_dict_type="sharded")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    params: Any = model.parameters()
    if groups == 2:
        params = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}]
    optimizer = torch.optim.AdamW(params, lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = DataLoader(TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1))), batch_size=2)
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, data)
    return {"accelerator": accelerator, "model": model, "optimizer": optimizer, "scheduler": scheduler, "data": data}


def train(run: dict[str, Any], steps: int) -> None:
    for _, (x,) in zip(range(steps), run["data"]):
        run["accelerator"].backward(run["model"](x).pow(2).mean())
        run["optimizer"].step()
        run["scheduler"].step()
        run["optimizer"].zero_grad()


def _local(tree: Any) -> Any:
    """A copy of a state with every (D)tensor as this rank's local values, as lists."""
    if isinstance(tree, torch.Tensor):
        return (tree.to_local() if hasattr(tree, "to_local") else tree).tolist()
    if isinstance(tree, dict):
        return {str(k): _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_local(v) for v in tree]
    return tree


def snapshot(run: dict[str, Any]) -> Any:
    return _local({"model": run["model"].state_dict(), "optimizer": run["optimizer"].state_dict(),
                   "scheduler": run["scheduler"].state_dict(), "data": run["data"].state_dict()})


def rewrite(folder: pathlib.Path, name: str, change: Callable[[Any], None]) -> None:
    obj = torch.load(folder / name, weights_only=True)
    change(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    (folder / name).write_bytes(buffer.getvalue())
    manifest = json.loads((folder / "manifest.json").read_text())
    size, crc = file_checksum(folder / name)
    manifest["files"][name] = {"size": size, "crc32": crc}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _group(values: dict[str, Any]) -> dict[str, Any]:
    return values["optimizer_0"]["param_groups"][0]


DAMAGE: dict[str, tuple[str, Callable[[Any], None]]] = {
    "garbage_state": ("shards/values.pt", lambda v: v["optimizer_0"].__setitem__("state", "garbage")),
    "lr_evil": ("shards/values.pt", lambda v: _group(v).__setitem__("lr", "evil")),
    "betas_xx": ("shards/values.pt", lambda v: _group(v).__setitem__("betas", "xx")),
    "no_groups": ("shards/values.pt", lambda v: v["optimizer_0"].__setitem__("param_groups", [])),
    "batches_consumed": ("data_states_1.pt", lambda s: s[0].__setitem__("batches_consumed", 10**9)),
    "order_consumed": ("data_states_1.pt", lambda s: s[0].__setitem__("order_consumed", 10**9)),
}


def attempt(run: dict[str, Any], folder: Any) -> dict[str, Any]:
    before = snapshot(run)
    try:
        outcome = f"loaded {run['accelerator'].load_state(folder)}"
    except Exception as err:  # reported to the test, which checks type and message
        outcome = f"{type(err).__name__}: {err}"
    return {"outcome": outcome, "unchanged": snapshot(run) == before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    out = parser.parse_args().out
    run = build(out)
    train(run, 2)
    first = pathlib.Path(run["accelerator"].save_state())
    at_first = snapshot(run)
    train(run, 2)
    newest = pathlib.Path(run["accelerator"].save_state())
    accelerator = run["accelerator"]
    if accelerator.is_main_process:
        for name, (file, change) in DAMAGE.items():
            shutil.copytree(newest, out / name)
            rewrite(out / name, file, change)
    accelerator.wait_for_everyone()
    victim = build(out)
    train(victim, 1)
    facts: dict[str, Any] = {name: attempt(victim, out / name) for name in DAMAGE}
    facts["two_groups"] = attempt(build(out, groups=2), newest)
    fresh = build(out)
    facts["fresh"] = attempt(fresh, out / "lr_evil")
    facts["fresh"]["optimizer_state"] = len(fresh["optimizer"].state_dict()["state"])
    if accelerator.is_main_process:
        rewrite(newest, "shards/values.pt", DAMAGE["lr_evil"][1])
    accelerator.wait_for_everyone()
    latest = build(out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts["latest"] = attempt(latest, None)
    facts["latest"]["warned"] = [str(w.message) for w in caught if "Skipping checkpoint" in str(w.message)]
    facts["latest"]["equal_to_first"] = snapshot(latest)["model"] == at_first["model"]
    facts["first"], facts["newest"] = first.name, newest.name
    (out / f"strict{accelerator.process_index}.json").write_text(json.dumps(facts))
    accelerator.end_training()


if __name__ == "__main__":
    main()
