"""One process of a 2-process job for `Trainer.test/validate/predict(ckpt_path=...)`:
`ckpt_path_worker.py --out DIR`.

For each strategy ("ddp", and "fsdp" whose checkpoints are sharded by default), a fit saves every 2
optimizer steps into DIR/<strategy>/ckpt ("{step}" names, save_top_k=2 by val_loss, save_last=True);
then on the same Trainer `test(ckpt_path="best")` and `validate(ckpt_path="last")`, and on a fresh
Trainer `predict(ckpt_path=<the best folder>)`; then `validate(ckpt_path=<a damaged copy>)`, which
every rank must refuse alike (none waits for the others). Each rank saves to DIR/rank{r}.pt, per
strategy: the Checkpointer's paths, the module's full weights after each call (under FSDP2 gathered
onto the main process; the other rank reports none), the predictions and the refusal's message.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import best_ckpt_worker  # a sibling in scripts/, which is on sys.path when a script runs
from fittrain import Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import CheckpointError


class Net(best_ckpt_worker.Net):
    """best_ckpt_worker's regressor (its lr makes the validation loss wobble), predicting too."""

    def predict_step(self, batch: Any) -> torch.Tensor:
        return self(batch[0])


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, torch.sin(3 * x.sum(1, keepdim=True)))


def run(out: pathlib.Path, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Net()
    checkpointer = Checkpointer(every_n_steps=2, dirpath=out / "ckpt", filename="{step}", monitor="val_loss",
                                save_top_k=2, save_last=True)
    trainer = Trainer(max_epochs=3, project_dir=out, val_every_n_steps=2, callbacks=[checkpointer],
                      strategy=strategy, enable_progress_bar=False)
    # 16 validation samples: 2 batches per rank, so that FSDP2's collective forwards pair up.
    val = DataLoader(data(16, 2), batch_size=4)
    trainer.fit(module, DataLoader(data(32, 1), batch_size=4, shuffle=True), val)

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in trainer.accelerator.distributed_strategy.full_state_dict(module).items()}

    result: dict[str, Any] = {"rank": trainer.accelerator.process_index, "best": checkpointer.best_model_path,
                              "last": checkpointer.last_checkpoint, "link": checkpointer.last_model_path,
                              "after_fit": weights()}
    result["test"] = trainer.test(module, val, ckpt_path="best")
    result["after_best"] = weights()
    trainer.validate(module, val, ckpt_path="last")
    result["after_last"] = weights()
    torch.manual_seed(1)
    fresh = Net()  # other initial weights: only the checkpoint's can give the predictions
    fresh_trainer = Trainer(strategy=strategy, enable_progress_bar=False)
    result["predicted"] = fresh_trainer.predict(fresh, DataLoader(data(8, 3), batch_size=4), all_processes=True,
                                                ckpt_path=checkpointer.best_model_path)
    damaged = out / "damaged"
    if trainer.accelerator.is_main_process:
        shutil.copytree(checkpointer.best_model_path, damaged)
        (damaged / "manifest.json").unlink()
    trainer.accelerator.wait_for_everyone()
    try:
        trainer.validate(module, val, ckpt_path=damaged)
        result["refused"] = None
    except CheckpointError as err:
        result["refused"] = str(err)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = pathlib.Path(parser.parse_args().out)
    results = {strategy: run(out / strategy, strategy) for strategy in ("ddp", "fsdp")}
    torch.save(results, out / f"rank{results['ddp']['rank']}.pt")
