"""One process of the 2-process LocalSGD and logging job: `local_sgd_worker.py --out DIR`.

Logging (fittrain.logging.get_logger), to stdout as "LOG <message>": one line before any
Accelerator exists (main process only), one on every process, and one `in_order=True` line per
process. Then LocalSGD(local_sgd_steps=2) over DDP, each rank on its own data: each rank saves
to DIR/rank{r}.pt its parameters after each of 4 steps, and what it held just before the
averaging steps. Last, LocalSGD under strategy="fsdp" must be refused; its message is saved.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys

import torch

from fittrain import Accelerator
from fittrain.local_sgd import LocalSGD
from fittrain.logging import get_logger

logging.basicConfig(stream=sys.stdout, format="LOG %(message)s", level=logging.WARNING)
logger = get_logger("local_sgd_worker", log_level="INFO")


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(acc: Accelerator) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)  # the same initial weights everywhere
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    data = torch.Generator().manual_seed(100 + acc.process_index)  # each rank its own batches
    after, before_average = [], []
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:
        for step in range(1, 5):
            x = torch.randn(8, 4, generator=data)
            with acc.accumulate(model):  # as Accelerate's by_feature/local_sgd.py
                loss = model(x).sub(x.sum(1, keepdim=True)).pow(2).mean()
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if step % 2 == 0:
                before_average.append(flat(model))
            local_sgd.step()
            after.append(flat(model))
    return {"after": after, "before_average": before_average}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    logger.info("before the accelerator")  # no process group yet: the rank comes from torchrun
    acc = Accelerator(cpu=True)
    logger.info("every process", main_process_only=False)
    logger.info("turn of %d", acc.process_index, in_order=True)
    results = train(acc)
    try:
        LocalSGD(Accelerator(cpu=True, strategy="fsdp"), torch.nn.Linear(2, 2), local_sgd_steps=2)
        results["refused"] = ""
    except NotImplementedError as err:
        results["refused"] = str(err)
    torch.save(results, out / f"rank{acc.process_index}.pt")
    acc.end_training()


if __name__ == "__main__":
    main()
