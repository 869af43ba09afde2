"""An Accelerate-style training script, converted to fittrain by changing its imports only.

Written for Hugging Face Accelerate, the way its docs and `examples/by_feature` scripts write one;
the original imports were

    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.test_utils import RegressionDataset, RegressionModel
    from accelerate.utils import ProjectConfiguration, set_seed

and nothing else differs. It needs no download. It trains the regression model three times in
one process (or one job of N processes):

1. uninterrupted, for `--epochs` epochs;
2. interrupted: automatic checkpoints (`ProjectConfiguration(automatic_checkpoint_naming=True)`)
   at each epoch's end and in the middle of the second epoch, where the run stops;
3. resumed from the newest checkpoint (`load_state()`), skipping the batches the interrupted
   run had already trained on (`skip_first_batches`), to the end.

Every run evaluates with `gather_for_metrics` (the evaluation set does not divide evenly between
processes) and logs to the experiment trackers (`log_with`, `init_trackers`, `log`,
`end_training`). At the end it checks that the resumed run ends with the uninterrupted run's
exact weights and evaluation loss. The shuffled order comes from `use_seedable_sampler=True`,
which Accelerate's docs recommend for runs that must resume reproducibly.

Run: `python -m torch.distributed.run --nproc-per-node N example_regression.py --project_dir DIR`.
"""

import argparse
import glob
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fittrain import Accelerator, DataLoaderConfiguration
from fittrain.utils import ProjectConfiguration, set_seed
from regression import RegressionDataset, RegressionModel


class TrainingProgress:
    """Where the run stands, saved with each checkpoint (`register_for_checkpointing`)."""

    def __init__(self):
        self.epoch = 0
        self.step_in_epoch = 0
        self.global_step = 0

    def state_dict(self):
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.step_in_epoch = state_dict["step_in_epoch"]
        self.global_step = state_dict["global_step"]


def evaluate(model, eval_dataloader, accelerator, num_samples):
    """Mean squared error over the whole evaluation set, every sample counted once."""
    model.eval()
    predictions, references = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(batch["x"])
        outputs, targets = accelerator.gather_for_metrics((outputs, batch["y"]))
        predictions.append(outputs)
        references.append(targets)
    predictions, references = torch.cat(predictions), torch.cat(references)
    assert len(predictions) == num_samples, f"gather_for_metrics gave {len(predictions)} samples, not {num_samples}"
    model.train()
    return F.mse_loss(predictions, references).item()


def training_function(config, project_dir, log_with, interrupt=False, resume=False):
    """One run; returns the accelerator, the unwrapped model and the last evaluation loss (None
    when `interrupt` stopped it after its mid-epoch checkpoint)."""
    project_config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2)
    dataloader_config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config["seed"])
    accelerator = Accelerator(project_config=project_config, dataloader_config=dataloader_config, log_with=log_with)
    set_seed(config["seed"])

    train_set = RegressionDataset(length=config["train_samples"], seed=config["seed"])
    eval_set = RegressionDataset(length=config["eval_samples"], seed=config["seed"] + 1)
    train_dataloader = DataLoader(train_set, batch_size=config["batch_size"], shuffle=True)
    eval_dataloader = DataLoader(eval_set, batch_size=config["batch_size"])
    model = RegressionModel(a=1, b=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    accelerator.init_trackers("regression_example", config=config)

    if resume:
        accelerator.print(f"Resuming from {accelerator.load_state()}")
    steps_per_epoch = len(train_dataloader)
    checkpoint_step = steps_per_epoch + steps_per_epoch // 2  # the middle of the second epoch
    eval_loss = None
    for epoch in range(progress.epoch, config["num_epochs"]):
        model.train()
        train_dataloader.set_epoch(epoch)
        if resume and progress.step_in_epoch > 0:
            # Skip the batches of this epoch the interrupted run already trained on.
            active_dataloader = accelerator.skip_first_batches(train_dataloader, progress.step_in_epoch)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            outputs = model(batch["x"])
            loss = F.mse_loss(outputs, batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress.step_in_epoch += 1
            progress.global_step += 1
            accelerator.log({"train_loss": loss.item(), "lr": lr_scheduler.get_last_lr()[0]}, step=progress.global_step)
            if progress.global_step == checkpoint_step:
                # An evaluation inside the training loop, then a checkpoint in the middle of the epoch.
                accelerator.log({"eval_loss": evaluate(model, eval_dataloader, accelerator, len(eval_set))},
                                step=progress.global_step)
                accelerator.save_state()
                if interrupt:
                    accelerator.print(f"Interrupted at step {progress.global_step}")
                    return accelerator, accelerator.unwrap_model(model), None
        progress.epoch, progress.step_in_epoch = epoch + 1, 0
        eval_loss = evaluate(model, eval_dataloader, accelerator, len(eval_set))
        accelerator.log({"eval_loss": eval_loss, "epoch": epoch}, step=progress.global_step)
        accelerator.save_state()
    return accelerator, accelerator.unwrap_model(model), eval_loss


def main():
    parser = argparse.ArgumentParser(description="Regression training with checkpoints, resume and trackers.")
    parser.add_argument("--project_dir", type=str, required=True, help="Where checkpoints and logs go.")
    parser.add_argument("--log_with", type=str, default="tensorboard", help="Experiment trackers to log to.")
    args = parser.parse_args()
    config = {"lr": 0.05, "num_epochs": 3, "seed": 42, "batch_size": 4, "train_samples": 64, "eval_samples": 27}

    _, full_model, full_eval_loss = training_function(config, os.path.join(args.project_dir, "full"), args.log_with)
    resumed_dir = os.path.join(args.project_dir, "resumed")
    training_function(config, resumed_dir, args.log_with, interrupt=True)
    accelerator, resumed_model, resumed_eval_loss = training_function(config, resumed_dir, args.log_with, resume=True)

    assert torch.equal(resumed_model.a.detach().cpu(), full_model.a.detach().cpu()), (
        f"Resumed run ended with a={resumed_model.a.item()}, the uninterrupted one with a={full_model.a.item()}"
    )
    assert torch.equal(resumed_model.b.detach().cpu(), full_model.b.detach().cpu()), (
        f"Resumed run ended with b={resumed_model.b.item()}, the uninterrupted one with b={full_model.b.item()}"
    )
    assert resumed_eval_loss == full_eval_loss, f"eval loss {resumed_eval_loss} != {full_eval_loss}"
    if accelerator.is_main_process:
        checkpoints = sorted(os.listdir(os.path.join(resumed_dir, "checkpoints")))
        assert len(checkpoints) <= 2, f"total_limit=2 kept {checkpoints}"
        events = glob.glob(os.path.join(resumed_dir, "**", "events.out.tfevents.*"), recursive=True)
        assert events or args.log_with not in ("tensorboard", "all"), "no TensorBoard event file was written"
    accelerator.print(f"example_regression OK: a={full_model.a.item():.6f} b={full_model.b.item():.6f} "
                      f"eval_loss={full_eval_loss:.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
