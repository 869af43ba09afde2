"""Writes two sharded FSDP2 checkpoints for tests/checkpoint/test_sharded_metadata.py to attack.

Run under torchrun: `sharded_metadata_worker.py --out DIR`. The model, optimizer and steps are
sharded_worker.py's. Saves `DIR/project/checkpoints/checkpoint_0` after one step and
`checkpoint_1` after two, and each time the whole weights (DIR/weights_{i}.pt, rank 0).
"""

from __future__ import annotations

import argparse
import pathlib

from sharded_worker import build, save_final, train_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    out = parser.parse_args().out
    accelerator, model, optimizer, scheduler, counter = build(out, "sharded")
    for index in range(2):
        train_step(accelerator, model, optimizer, scheduler, counter)
        accelerator.save_state()
        save_final(accelerator, model, out / f"weights_{index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
