"""One process of an FSDP2 job that saves and loads sharded checkpoints (torch.distributed.checkpoint).

Run under torchrun: `sharded_worker.py MODE --out DIR [...]`. The model is a small MLP trained
with AdamW and a StepLR schedule; step s trains on a global batch drawn from a generator seeded
with s, each rank taking its rows, so any number of processes trains on the same global batches
(the same mathematics, up to the order of floating-point reductions).

Modes:
    resume      trains --steps, saving a sharded checkpoint after --save-at; then a
                fresh model, optimizer and Accelerator load it and train the rest: the two ends
                must be bitwise equal. Writes DIR/rank{r}.json, DIR/final_resume.pt, the weights
                loaded from the checkpoint to DIR/at_checkpoint.pt, and the
                weights with save_model(max_shard_size="100KB") to DIR/weights.
    continue    loads --ckpt (or, without it, the newest under DIR/project) and trains to --steps;
                writes DIR/final_{--tag}.pt.
    reference   trains --steps without saving; writes DIR/final_{--tag}.pt.
    async       saves with save_state(async_save=True) after every step (automatic naming, each
                shard write slowed by --slow seconds) until killed or --steps.
    load        tries load_state(--ckpt), then load_state() (the newest intact one); writes what
                each raised or loaded to DIR/load{r}.json.
    full-disk   saves after step 1; then rank 1 may write no file over 100 KB (RLIMIT_FSIZE: its
                writes fail with EFBIG, as on a full disk) and saves after step 2; then the limit
                goes and the same save is tried again. Writes what each save raised or returned to
                DIR/disk{r}.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fittrain import Accelerator, ProjectConfiguration
from fittrain.checkpoint import snapshot

GLOBAL_BATCH = 8


class StepCounter:
    """The number of steps trained, saved in every checkpoint (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def build(out: pathlib.Path, state_dict_type: str) -> tuple[Accelerator, Any, Any, Any, StepCounter]:
    project = ProjectConfiguration(out / "project", automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(strategy="fsdp", project_config=project, state_dict_type=state_dict_type)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def train_step(accelerator: Accelerator, model: Any, optimizer: Any, scheduler: Any, counter: StepCounter) -> None:
    generator = torch.Generator().manual_seed(1000 + counter.step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=generator), torch.randn(GLOBAL_BATCH, 1, generator=generator)
    share = GLOBAL_BATCH // accelerator.num_processes
    rows = slice(accelerator.process_index * share, (accelerator.process_index + 1) * share)
    loss = F.mse_loss(model(x[rows]), y[rows])
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    counter.step += 1


def save_final(accelerator: Accelerator, model: Any, path: pathlib.Path) -> dict[str, torch.Tensor]:
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(weights, path)
    return weights


def resume(args: argparse.Namespace) -> None:
    out = args.out
    accelerator, model, optimizer, scheduler, counter = build(out, args.state_dict_type)
    for _ in range(args.save_at):
        train_step(accelerator, model, optimizer, scheduler, counter)
    folder = accelerator.save_state()
    while counter.step < args.steps:
        train_step(accelerator, model, optimizer, scheduler, counter)
    first = save_final(accelerator, model, out / "final_uninterrupted.pt")
    accelerator, model, optimizer, scheduler, counter = build(out, args.state_dict_type)
    accelerator.load_state(folder)
    save_final(accelerator, model, out / "at_checkpoint.pt")
    resumed_at = counter.step
    while counter.step < args.steps:
        train_step(accelerator, model, optimizer, scheduler, counter)
    second = save_final(accelerator, model, out / "final_resume.pt")
    accelerator.save_model(model, out / "weights", max_shard_size="100KB")  # streamed, shard by shard
    rank = accelerator.process_index
    facts = {"resumed_at": resumed_at, "num_processes": accelerator.num_processes,
             "equal": all(torch.equal(first[k], second[k]) for k in first) and list(first) == list(second),
             "local_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
             "default_type": Accelerator(strategy="fsdp").state_dict_type}
    (out / f"rank{rank}.json").write_text(json.dumps(facts))


def continue_run(args: argparse.Namespace) -> None:
    accelerator, model, optimizer, scheduler, counter = build(args.out, args.state_dict_type)
    accelerator.load_state(args.ckpt)
    while counter.step < args.steps:
        train_step(accelerator, model, optimizer, scheduler, counter)
    save_final(accelerator, model, args.out / f"final_{args.tag}.pt")


def reference(args: argparse.Namespace) -> None:
    accelerator, model, optimizer, scheduler, counter = build(args.out, args.state_dict_type)
    while counter.step < args.steps:
        train_step(accelerator, model, optimizer, scheduler, counter)
    save_final(accelerator, model, args.out / f"final_{args.tag}.pt")


def async_saves(args: argparse.Namespace) -> None:
    write_shards = snapshot.write_shards

    def slow(*arguments: Any) -> None:  # the kill must land while shards are being written
        time.sleep(args.slow)
        write_shards(*arguments)

    snapshot.write_shards = slow
    accelerator, model, optimizer, scheduler, counter = build(args.out, args.state_dict_type)
    while counter.step < args.steps:
        train_step(accelerator, model, optimizer, scheduler, counter)
        accelerator.save_state(async_save=True)
        print(f"rank {accelerator.process_index} saved step {counter.step}", flush=True)
    accelerator.end_training()


def load(args: argparse.Namespace) -> None:
    accelerator, model, optimizer, scheduler, counter = build(args.out, args.state_dict_type)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    facts: dict[str, Any] = {}
    try:
        accelerator.load_state(args.ckpt)
        facts["explicit"] = "loaded"
    except Exception as err:  # reported to the test, which checks type and message
        facts["explicit"] = f"{type(err).__name__}: {err}"
    facts["unchanged"] = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    try:
        facts["newest"] = pathlib.Path(accelerator.load_state()).name
    except Exception as err:
        facts["newest"] = f"{type(err).__name__}: {err}"
    facts["step"] = counter.step
    (args.out / f"load{accelerator.process_index}.json").write_text(json.dumps(facts))


def full_disk(args: argparse.Namespace) -> None:
    import resource
    import signal

    accelerator, model, optimizer, scheduler, counter = build(args.out, args.state_dict_type)
    facts: dict[str, Any] = {}
    train_step(accelerator, model, optimizer, scheduler, counter)
    facts["first"] = pathlib.Path(accelerator.save_state()).name
    train_step(accelerator, model, optimizer, scheduler, counter)
    unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
    if accelerator.process_index == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, unlimited[1]))
    try:
        accelerator.save_state()
        facts["failed"] = "returned"
    except Exception as err:  # reported to the test, which checks type, errno and message
        facts["failed"] = f"{type(err).__name__}: {err}"
        facts["errno"] = getattr(err, "errno", None)
    resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
    facts["retry"] = pathlib.Path(accelerator.save_state()).name
    (args.out / f"disk{accelerator.process_index}.json").write_text(json.dumps(facts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("resume", "continue", "reference", "async", "load", "full-disk"))
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--state-dict-type", default="sharded")
    args = parser.parse_args()
    {"resume": resume, "continue": continue_run, "reference": reference, "async": async_saves,
     "load": load, "full-disk": full_disk}[args.mode](args)


if __name__ == "__main__":
    main()
