"""One leg of an elastic chain: train on however many processes torchrun starts, from scratch or
from a checkpoint saved by another number of processes, then save and stop, or run to the end.

Two loops: `--mode trainer` (Trainer.fit, saving from a callback) and `--mode loop` (an
Accelerate-style loop: load_state, then skip_first_batches(dl, dl.position.batches_consumed)).
Every rank records, for each optimizer step, the dataset indices it trained on
(`{out}/{tag}_rank{r}.pt`); rank 0 writes the final full weights to `{out}/{tag}.safetensors`.

The data and the model are float64 and hold no randomness but the shuffle (a DataLoader
generator), so a one-process simulation of the same global batches (tests/resume/test_elastic.py)
reaches the same weights up to floating-point reduction order.
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import random
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SAMPLES, BATCH_SIZE, EPOCHS, ORDER_SEED, LR, MOMENTUM = 22, 2, 3, 17, 0.1, 0.9


class Indexed(Dataset):
    """Fixed float64 samples (independent of any global seed), each with its index."""

    def __init__(self, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(4321)
        self.x = torch.randn(n, 3, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def make_loader() -> DataLoader:
    # The order comes from the loader's generator only, so it is the same on any number of processes.
    return DataLoader(Indexed(), batch_size=BATCH_SIZE, shuffle=True,
                      generator=torch.Generator().manual_seed(ORDER_SEED))


def make_net() -> nn.Module:
    torch.manual_seed(0)  # a resumed leg seeds otherwise first; its weights come from the checkpoint
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def make_accelerator(args: argparse.Namespace) -> Any:
    from fittrain import Accelerator

    options: dict[str, Any] = {"strategy": args.strategy}
    if "state_dict_type" in inspect.signature(Accelerator).parameters:
        options["state_dict_type"] = args.state_dict_type
    return Accelerator(**options)


def run_trainer(args: argparse.Namespace, records: list[tuple[int, int, list[int]]]) -> tuple[Any, Any]:
    from fittrain import Callback, Trainer, TrainModule

    class Net(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: Any) -> torch.Tensor:
            x, y, index = batch
            state = self.trainer.state
            records.append((state.global_step + 1, state.epoch, index.tolist()))
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.parameters())

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer: Trainer) -> None:
            if trainer.accelerator.sync_gradients and trainer.state.global_step == args.save_at:
                trainer.accelerator.save_state(args.checkpoint)

    trainer = Trainer(max_epochs=EPOCHS, max_steps=args.save_at, project_dir=args.out / "project",
                      resume_from=args.resume, accelerator=make_accelerator(args), callbacks=[SaveAt()],
                      preemption_signals=())
    module = Net()
    trainer.fit(module, make_loader())
    return trainer.accelerator, trainer.model


def run_loop(args: argparse.Namespace, records: list[tuple[int, int, list[int]]]) -> tuple[Any, Any]:
    class Steps:
        """The optimizer steps taken, registered for checkpointing."""

        count = 0

        def state_dict(self) -> dict[str, int]:
            return {"count": self.count}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.count = state["count"]

    acc, steps = make_accelerator(args), Steps()
    net = make_net()
    model, optimizer, dl = acc.prepare(net, make_optimizer(net.parameters()), make_loader())
    acc.register_for_checkpointing(steps)
    if args.resume is not None:
        acc.load_state(args.resume)
    # The documented recipe; after an elastic resume the position is in this run's batches.
    start_epoch, skip = dl.position.epoch, dl.position.batches_consumed
    for epoch in range(start_epoch, EPOCHS):
        for x, y, index in acc.skip_first_batches(dl, skip) if epoch == start_epoch else dl:
            records.append((steps.count + 1, epoch, index.tolist()))
            acc.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps.count += 1
            if steps.count == args.save_at:
                acc.save_state(args.checkpoint)
                return acc, model
    return acc, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("trainer", "loop"), required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tag", required=True, help="names this leg's files in --out")
    parser.add_argument("--resume", help="the checkpoint to start from")
    parser.add_argument("--save-at", type=int, help="save --checkpoint after this optimizer step and stop")
    parser.add_argument("--checkpoint", type=pathlib.Path)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--state-dict-type", default="full")
    args = parser.parse_args()
    torch.manual_seed(999), random.seed(999), np.random.seed(999)  # whatever is not restored differs
    records: list[tuple[int, int, list[int]]] = []
    acc, model = (run_trainer if args.mode == "trainer" else run_loop)(args, records)
    torch.save(records, args.out / f"{args.tag}_rank{acc.process_index}.pt")
    weights = acc.get_state_dict(model)  # every rank: FSDP2 gathers
    if acc.is_main_process:
        safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()},
                                    args.out / f"{args.tag}.safetensors")
    acc.wait_for_everyone()


if __name__ == "__main__":
    main()
