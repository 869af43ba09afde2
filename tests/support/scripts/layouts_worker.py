"""One process of a 4-process job that trains gpt.py's model under every layout of a device mesh.

Run as `layouts_worker.py --out DIR` on 4 ranks; each rank saves what it saw to DIR/rank{r}.pt:

- layouts: for DDP, FSDP2, HSDP, TP, FSDP2+TP and replication+TP: an epoch, a save of its own
  (sharded), the next epoch, then the checkpoint loaded back and that epoch again. Losses, weights,
  the first batch's sample indices and every sample index seen (gather_for_metrics);
- cross: the FSDP2+TP checkpoint loaded under each other layout;
- elastic: a (dp_shard 2, tp 2) run stopped after 3 steps, saved, and resumed as (dp_shard 4);
- stream: an IterableDataset's loader under (dp_shard 2, tp 2);
- full: a full (gathered) checkpoint and save_model's weights saved under TP; the checkpoint loaded
  under FSDP2+TP;
- accumulate, compiled, split_by_hand, bf16: FSDP2+TP with gradient accumulation, compiled, and with
  a model split before prepare on `accelerator.torch_device_mesh["tp"]`; TP under bf16 autocast;
- trainer: `Trainer(parallelism_config=...)` with the model inside a TrainModule, and the same fit
  resumed from a mid-epoch checkpoint;
- memory: the bytes this rank holds under each layout, and what a forward leaves allocated, for
  `estimate_memory`.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import gpt
import training
from fittrain import Accelerator, ParallelismConfig, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint.run_folders import run_folder

LAYOUTS = gpt.LAYOUTS


def _accelerator(layout: str, **options: Any) -> Accelerator:
    return Accelerator(parallelism_config=ParallelismConfig(**LAYOUTS[layout]), fsdp_classes=[gpt.Block], **options)


def _mesh(mesh: Any) -> Any:
    return None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names)


def layouts(out: pathlib.Path) -> dict[str, Any]:
    results = {}
    for name in LAYOUTS:
        acc = _accelerator(name)
        model, optimizer, loader = gpt.prepared(acc)
        seen: list[int] = []
        norms: list[float] = []
        first = gpt.train_epoch(acc, model, optimizer, loader, seen, norms)
        saved = gpt.full_state(acc, model)
        folder = acc.save_state(out / f"{name}_checkpoint")
        second = gpt.train_epoch(acc, model, optimizer, loader)
        after = gpt.full_state(acc, model)
        acc.load_state(folder)
        again = gpt.train_epoch(acc, model, optimizer, loader)
        results[name] = {"losses": first + second, "again": again, "saved": saved, "after": after,
                         "again_state": gpt.full_state(acc, model), "seen": seen, "norms": norms,
                         "first_batch": next(iter(loader))[1].tolist(),
                         "strategy": repr(acc.distributed_strategy), "mesh": _mesh(acc.torch_device_mesh),
                         "ranks": (acc.data_parallel_rank, acc.data_parallel_shard_rank, acc.tensor_parallel_rank),
                         "is_fsdp2": acc.is_fsdp2}
    return results


def cross(out: pathlib.Path) -> dict[str, Any]:
    loaded = {}
    for name in LAYOUTS:
        acc = _accelerator(name)
        model, _, _ = gpt.prepared(acc, seed=5)
        acc.load_state(out / "fsdp_tp_checkpoint")
        loaded[name] = gpt.full_state(acc, model)
    return loaded


def elastic(out: pathlib.Path) -> dict[str, Any]:
    acc = _accelerator("fsdp_tp")
    model, optimizer, loader = gpt.prepared(acc)
    before: list[int] = []
    for step, (tokens, index) in enumerate(loader):
        acc.backward(gpt.loss_of(model, tokens))
        optimizer.step()
        optimizer.zero_grad()
        before.extend(int(i) for i in acc.gather_for_metrics(index))
        if step == 2:
            acc.save_state(out / "elastic_checkpoint")
            break
    acc = _accelerator("fsdp")
    model, optimizer, loader = gpt.prepared(acc, seed=5)
    acc.load_state(out / "elastic_checkpoint")
    after: list[int] = []
    rest = acc.skip_first_batches(loader, loader.position.batches_consumed)  # Accelerate's resume pattern
    gpt.train_epoch(acc, model, optimizer, rest, after)
    return {"before": before, "after": after}


def stream(out: pathlib.Path) -> dict[str, Any]:
    """A stream (IterableDataset) under FSDP2+TP: dealt by data-parallel rank too."""
    acc = _accelerator("fsdp_tp")
    model = gpt.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=gpt.LR)
    loader = torch.utils.data.DataLoader(gpt.TokenStream(), batch_size=gpt.GLOBAL_BATCH // 2)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    seen: list[int] = []
    gpt.train_epoch(acc, model, optimizer, loader, seen)
    return {"seen": seen, "first_batch": next(iter(loader))[1].tolist()}


def full(out: pathlib.Path) -> dict[str, Any]:
    acc = _accelerator("tp", state_dict_type="full")
    model, optimizer, loader = gpt.prepared(acc)
    gpt.train_epoch(acc, model, optimizer, loader)
    saved = gpt.full_state(acc, model)
    acc.save_state(out / "full_checkpoint")
    acc.save_model(model, out / "tp_model")  # the whole weights, streamed from the split ones
    acc = _accelerator("fsdp_tp")
    model, _, _ = gpt.prepared(acc, seed=5)
    acc.load_state(out / "full_checkpoint")
    files = sorted(p.name for p in (out / "full_checkpoint").iterdir())
    return {"saved": saved, "loaded": gpt.full_state(acc, model), "files": files}


def accumulate(out: pathlib.Path) -> dict[str, Any]:
    acc = _accelerator("fsdp_tp", gradient_accumulation_steps=2)
    model, optimizer, loader = gpt.prepared(acc, accumulation=2)
    losses = gpt.train_epoch(acc, model, optimizer, loader)
    return {"state": gpt.full_state(acc, model), "steps": len(losses)}


def compiled(out: pathlib.Path) -> dict[str, Any]:
    """FSDP2+TP with each block compiled (aot_eager: Dynamo traces the DTensor code; no C++ build)."""
    acc = _accelerator("fsdp_tp", dynamo_backend="aot_eager")
    model, optimizer, loader = gpt.prepared(acc)
    return {"losses": gpt.train_epoch(acc, model, optimizer, loader)}


def split_by_hand(out: pathlib.Path) -> dict[str, Any]:
    """A model split before prepare on the Accelerator's own tp mesh (Accelerate's way, where
    transformers' from_pretrained(device_mesh=...) splits it): prepare does not split it again."""
    from torch.distributed.tensor.parallel import parallelize_module

    from fittrain.distributed.strategies.tp_plan import resolve_plan

    acc = _accelerator("fsdp_tp")
    model = gpt.make_model()
    parallelize_module(model, acc.torch_device_mesh["tp"], resolve_plan(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=gpt.LR)
    model, optimizer, loader = acc.prepare(model, optimizer, gpt.make_loader(gpt.GLOBAL_BATCH // 2))
    return {"losses": gpt.train_epoch(acc, model, optimizer, loader)}


def bf16(out: pathlib.Path) -> dict[str, Any]:
    acc = _accelerator("tp", mixed_precision="bf16")
    model, optimizer, loader = gpt.prepared(acc)
    return {"losses": gpt.train_epoch(acc, model, optimizer, loader)}


class _LanguageModel(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = gpt.make_model()  # its tp_plan counts under the name "gpt"

    def training_step(self, batch: Any) -> torch.Tensor:
        return gpt.loss_of(self.gpt, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=gpt.LR)


def _fit(project: pathlib.Path, resume: str | None = None) -> Trainer:
    fit = Trainer(parallelism_config=ParallelismConfig(**LAYOUTS["fsdp_tp"]), max_epochs=2, project_dir=project,
                  enable_progress_bar=False, callbacks=[Checkpointer(every_n_steps=3)], resume_from=resume)
    fit.fit(_LanguageModel(), gpt.make_loader(gpt.GLOBAL_BATCH // 2))
    return fit


def trainer(out: pathlib.Path) -> dict[str, Any]:
    """Two epochs of `Trainer.fit`, then the same fit resumed from its checkpoint after step 3 (mid-epoch)."""
    whole = _fit(out / "trainer")
    weights = gpt.full_state(whole.accelerator, whole.model)
    resumed = _fit(out / "trainer", resume=str(run_folder(out / "trainer") / "checkpoint_0"))
    return {"loss": float(whole.state.loss), "steps": whole.state.global_step,
            "strategy": repr(whole.accelerator.distributed_strategy), "weights": weights,
            "resumed": gpt.full_state(resumed.accelerator, resumed.model), "resumed_steps": resumed.state.global_step}


def _forward_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """What one forward leaves allocated (the activations saved for backward, and the output): the
    net of the CPU allocations torch's profiler records while it runs. The least of 3 forwards: a
    collective's buffer still held when the profile ends only ever adds."""
    def once() -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            output = model(tokens)
        del output
        return sum(event.self_cpu_memory_usage for event in prof.events())

    return min(once() for _ in range(3))


def memory(out: pathlib.Path) -> dict[str, Any]:
    """The bytes this rank holds after an AdamW step, and what a forward leaves allocated, per layout."""
    held = {}
    for name in LAYOUTS:
        acc = _accelerator(name)
        model, optimizer, loader = gpt.prepared(acc)
        tokens = next(iter(loader))[0]
        acc.backward(gpt.loss_of(model, tokens))
        optimizer.step()
        # A batch large enough that its activations, not the few buffers a forward also keeps, count.
        probe = torch.randint(0, gpt.VOCAB, (64, gpt.LENGTH), generator=torch.Generator().manual_seed(3))
        held[name] = {**training.held_bytes(model, optimizer), "activations": _forward_bytes(model, probe),
                      "batch": tuple(probe.shape)}
    return held


SCENARIOS = {"layouts": layouts, "cross": cross, "elastic": elastic, "stream": stream, "full": full,
             "accumulate": accumulate, "compiled": compiled, "split_by_hand": split_by_hand, "bf16": bf16,
             "trainer": trainer, "memory": memory}


if __name__ == "__main__":
    sys.exit(training.run_scenarios(SCENARIOS))
