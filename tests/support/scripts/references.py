"""Runs several reference jobs of train_job.py and plain_loop.py one after another in one process.

References never resume, so they need no fresh process; running them together pays for
importing torch once. Usage:

    python references.py DONE_FILE train|plain ARGS... [--then train|plain ARGS...]...

`DONE_FILE` is created when every run has finished, so resumed jobs started early can wait for it.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import plain_loop  # noqa: E402
import train_job  # noqa: E402


def main() -> None:
    done, argv = pathlib.Path(sys.argv[1]), sys.argv[2:]
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    torch.set_num_threads(1)
    for kind, *args in runs:
        if kind == "train":
            train_job.run(train_job.parse_args(args))
        elif kind == "plain":
            plain_loop.train(plain_loop.parse_args(args))
        else:
            raise SystemExit(f"unknown run kind {kind!r}; use 'train' or 'plain'")
    done.touch()


if __name__ == "__main__":
    main()
