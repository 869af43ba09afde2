"""One process of the 2-process tracker job: `trackers_worker.py --out DIR`.

Every rank runs the same code: `Accelerator(log_with=...)`, `init_trackers`, `log` (each rank
logs its own rank as the value) and `get_tracker`, then a 2-process `Trainer.fit` with a
`Logger` writing TensorBoard and CSV. Only rank 0 may write; each rank saves to DIR/rank{r}.pt
the class names of the trackers it held.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, Trainer, TrainModule
from fittrain.callbacks import Logger


class Regressor(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    acc = Accelerator(cpu=True, log_with=["tensorboard", "csv"], project_dir=out / "direct")
    acc.init_trackers("exp", config={"lr": 0.1})
    for step in (1, 2, 3):
        acc.log({"rank": float(acc.process_index)}, step=step)
    acc.get_tracker("tensorboard", unwrap=True).add_scalar("via_writer", float(acc.process_index), 1)
    held = [type(t).__name__ for t in acc.trackers]
    acc.wait_for_everyone()

    torch.manual_seed(0)
    x = torch.randn(32, 3)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    logger = Logger(every_n_steps=1, progress_bar=False, log_with=["tensorboard", "csv"], run_name="fit")
    trainer = Trainer(max_epochs=1, callbacks=[logger], accelerator=acc)
    trainer.fit(Regressor(), loader)
    torch.save({"held": held, "steps": trainer.state.global_step}, out / f"rank{acc.process_index}.pt")
    acc.end_training()


if __name__ == "__main__":
    main()
