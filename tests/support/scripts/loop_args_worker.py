"""One process of a 2-process job on Lightning's loop arguments: `loop_args_worker.py --out DIR`.

Runs, on each rank, fits with limit_*_batches and a sanity check, with overfit_batches, with
max_time (each rank's Timer reads a clock of its own: rank 0's spends the budget at step 3,
rank 1's at once, so only the main process's decision can make both stop at step 3), and a
limited epoch interrupted and resumed in the same job; saves each case's results per rank to
DIR/rank{r}.pt. `fit_limits` and `fit_overfit` also run in the test process with one process and
twice the batch, as references.
"""

from __future__ import annotations

import argparse
import pathlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint.run_folders import run_folder


class Indexed(Dataset):
    """n regression samples, each with its index."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Net(TrainModule):
    """A linear regression recording the sample indices each training step read."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.trained: list[list[int]] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y, index = batch
        self.trained.append(index.tolist())
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _result(trainer: Trainer, module: Net) -> dict[str, Any]:
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "should_stop": trainer.state.should_stop, "metrics": trainer.state.metrics, "trained": module.trained,
            "num_training_batches": trainer.num_training_batches}


def _trainer(project_dir: str, **kwargs: Any) -> Trainer:
    return Trainer(project_dir=project_dir, enable_progress_bar=False, **kwargs)


def fit_limits(batch_size: int, project_dir: str, sanity: int = 1) -> dict[str, Any]:
    """Half of each epoch (0.5) trained, one validation batch per process, and a sanity check (the
    reference runs none: the sanity check must not change what training draws)."""
    torch.manual_seed(0)
    module = Net()
    trainer = _trainer(project_dir, max_epochs=2, limit_train_batches=0.5, limit_val_batches=1,
                       num_sanity_val_steps=sanity)
    trainer.fit(module, DataLoader(Indexed(32), batch_size=batch_size, shuffle=True),
                DataLoader(Indexed(16, seed=1), batch_size=batch_size, shuffle=True))
    return _result(trainer, module)


def fit_overfit(batch_size: int, project_dir: str) -> dict[str, Any]:
    """Three epochs on the first batch of each process, read in order."""
    torch.manual_seed(0)
    module = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shuffling sampler is replaced
        trainer = _trainer(project_dir, max_epochs=3, overfit_batches=1)
        trainer.fit(module, DataLoader(Indexed(32), batch_size=batch_size, shuffle=True))
    return _result(trainer, module)


def fit_max_time(project_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Net()
    trainer = _trainer(project_dir, max_epochs=5, max_time={"seconds": 25})
    if trainer.accelerator.is_main_process:
        trainer.timer.clock = lambda: 10.0 * trainer.state.global_step  # spent after step 3
    else:
        trainer.timer.clock = lambda: 1e9 * trainer.state.global_step  # would stop after step 1
    trainer.fit(module, DataLoader(Indexed(32), batch_size=4))
    return _result(trainer, module)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


def fit_resumed(project_dir: str, crash: bool = False, resume_from: Any = None, seed: int = 0) -> dict[str, Any]:
    """3 of each epoch's 4 batches for 2 epochs, a checkpoint after every step; optionally interrupted after
    step 5 (epoch 1's second batch) or resumed."""
    torch.manual_seed(seed)
    module = Net()
    callbacks = [Checkpointer(every_n_steps=1), *([CrashAt(5)] if crash else [])]
    trainer = _trainer(project_dir, callbacks=callbacks, max_epochs=2, limit_train_batches=3, resume_from=resume_from)
    trainer.fit(module, DataLoader(Indexed(32), batch_size=4, shuffle=True))
    return _result(trainer, module)


def resume_case(out: pathlib.Path) -> dict[str, Any]:
    full = fit_resumed(str(out / "full"))
    try:
        fit_resumed(str(out / "cut"), crash=True)
    except RuntimeError:
        pass  # both ranks raise after the same step
    resumed = fit_resumed(str(out / "cut"), resume_from=run_folder(out / "cut") / "checkpoint_3", seed=123)  # step 4
    return {"full": full, "resumed": resumed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    results = {"limits": fit_limits(4, str(out / "limits")), "overfit": fit_overfit(4, str(out / "overfit")),
               "max_time": fit_max_time(str(out / "max_time")), "resume": resume_case(out / "resume")}
    rank = torch.distributed.get_rank()
    torch.save(results, out / f"rank{rank}.pt")
