"""A stateful callback: an exponential moving average (EMA) of the weights, saved in checkpoints.

`EMA` keeps a shadow copy of the weights and moves it a little towards the live weights after
every optimizer step. Its `state_dict()` (the shadow tensors and a counter) is written into
every checkpoint, and `load_state_dict()` restores it, so a resumed run continues the same
average instead of starting a new one.

The script trains for a few epochs with a Checkpointer, compares the validation loss of the
live and the averaged weights, then resumes from the newest checkpoint for more epochs and
shows that the average continued from the checkpoint.

Run it:      python examples/custom_callback.py
Tiny sizes:  python examples/custom_callback.py --smoke
"""

import argparse
import contextlib
import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer


class EMA(Callback):
    """Keeps `shadow = decay * shadow + (1 - decay) * weights` after every optimizer step.

    Args:
        decay: How much of the old average each update keeps.
    """

    def __init__(self, decay: float = 0.99) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"`EMA(decay=...)` must be between 0 and 1. Received: decay={decay!r}.")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}
        self.num_updates = 0
        self._seen_step = 0

    def on_fit_start(self, trainer):
        # A new fit starts a new average; when it resumes, load_state_dict runs after this.
        self.shadow, self.num_updates, self._seen_step = {}, 0, 0

    def on_train_batch_end(self, trainer):
        step = trainer.state.global_step
        # Inside an accumulation window the step does not move; an fp16 overflow skips the step.
        if step == self._seen_step or trainer.accelerator.optimizer_step_was_skipped:
            return
        self._seen_step = step
        with torch.no_grad():
            for name, value in self._weights(trainer.module).items():
                average = self.shadow.get(name)
                if average is None:
                    self.shadow[name] = value.detach().clone()
                else:
                    if average.device != value.device:  # restored from a checkpoint: tensors load on the CPU
                        average = self.shadow[name] = average.to(value.device)
                    average.lerp_(value.detach(), 1.0 - self.decay)
        self.num_updates += 1

    @staticmethod
    def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}

    @contextlib.contextmanager
    def averaged_weights(self, module: nn.Module):
        """Inside the block, `module` holds the averaged weights; its own come back afterwards."""
        own = {k: v.detach().clone() for k, v in self._weights(module).items()}
        module.load_state_dict(self.shadow, strict=False)
        try:
            yield module
        finally:
            module.load_state_dict(own, strict=False)

    # The state that travels inside every checkpoint. Tensors, numbers, strings, lists and dicts
    # are allowed: checkpoints are read back with torch.load(weights_only=True).
    def state_dict(self):
        return {"shadow": self.shadow, "num_updates": self.num_updates, "seen_step": self._seen_step}

    def load_state_dict(self, state):
        self.shadow = dict(state["shadow"])
        self.num_updates = int(state["num_updates"])
        self._seen_step = int(state["seen_step"])


class NoisyRegressor(TrainModule):
    """Fits y = sin(x0) + x1 with a learning rate high enough that the weights jitter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def make_data(samples: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(samples, 2, generator=g) * 4 - 2
    y = torch.sin(x[:, :1]) + x[:, 1:] + 0.3 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description="An EMA-of-weights callback whose state is checkpointed.")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 2, 64

    torch.manual_seed(0)
    train = DataLoader(make_data(args.samples, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(make_data(512, seed=2), batch_size=256)
    with tempfile.TemporaryDirectory() as project:
        ema = EMA(decay=0.95)
        # EMA comes before Checkpointer: callbacks run in list order, so with every_n_steps a
        # checkpoint taken at the end of a batch already contains that batch's EMA update.
        trainer = Trainer(max_epochs=args.epochs, project_dir=project,
                          callbacks=[ema, Checkpointer(every_n_epochs=1, total_limit=2)])
        module = NoisyRegressor()
        trainer.fit(module, train, val)
        live = trainer.validate(module, val)["val_loss"]
        with ema.averaged_weights(module):
            averaged = trainer.validate(module, val)["val_loss"]
        print(f"after {trainer.state.global_step} steps: val_loss live weights {live:.4f}, EMA weights {averaged:.4f}")

        saved = torch.load(f"{trainer.callbacks[1].last_checkpoint}/custom_checkpoint_1.pt", weights_only=True)
        ema_state = saved["0:EMA"]  # callback states are keyed "position:ClassName"
        print(f"the checkpoint holds the EMA state: {len(ema_state['shadow'])} tensors, "
              f"{ema_state['num_updates']} updates")

        resumed_ema = EMA(decay=0.95)
        resumed = Trainer(max_epochs=args.epochs + 2, project_dir=project, resume_from="latest",
                          callbacks=[resumed_ema, Checkpointer(every_n_epochs=1, total_limit=2)])
        resumed.fit(NoisyRegressor(), train, val)
        steps = resumed.state.global_step
        print(f"resumed for 2 more epochs: EMA updates {resumed_ema.num_updates}, global_step {steps}, "
              f"continued from the checkpoint: {resumed_ema.num_updates == steps}")


if __name__ == "__main__":
    main()
