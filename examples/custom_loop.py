"""The seed tutorial's loop: a hand-written PyTorch loop on fittrain's Accelerator.

Run it with `python examples/custom_loop.py`, or on two processes with
`fittrain launch --num_processes 2 examples/custom_loop.py`. It saves the weights to
outputs/custom_loop (outputs/custom_loop_smoke with `--smoke`, tiny sizes).
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator


def make_data(n: int) -> TensorDataset:
    """Noisy samples of y = sin(3x) + x/2, a curve a small MLP learns in seconds."""
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=generator) * 4 - 2
    y = torch.sin(3 * x) + x / 2 + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:
        args.epochs, args.samples = 1, 64
    output_dir = "outputs/custom_loop_smoke" if args.smoke else "outputs/custom_loop"  # never mix the two

    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    training_dataloader = DataLoader(make_data(args.samples), batch_size=32, shuffle=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(training_dataloader))
    loss_function = nn.MSELoss()

    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    for epoch in range(args.epochs):
        total = torch.zeros((), device=accelerator.device)
        for inputs, targets in training_dataloader:
            with accelerator.accumulate(model):
                outputs = model(inputs)
                loss = loss_function(outputs, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.detach()
        mean = accelerator.reduce(total / len(training_dataloader), reduction="mean")
        accelerator.print(f"epoch {epoch:2d}  loss {mean.item():.4f}")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, output_dir)
    accelerator.print(f"weights saved to {output_dir}/model.safetensors")
    accelerator.end_training()


if __name__ == "__main__":
    main()
