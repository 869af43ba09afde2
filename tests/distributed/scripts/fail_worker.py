"""A 2-process job that goes wrong on purpose: `fail_worker.py raise` or `fail_worker.py stall`.

raise: rank 1 prints the time and raises while rank 0 waits in a barrier that can never
    complete. The launcher must end the job with rank 1's exit code instead of leaving rank 0
    waiting.
stall: rank 1 stays alive but never joins rank 0's all-reduce. Rank 0's collective must fail
    after FITTRAIN_COLLECTIVE_TIMEOUT; it reports how long it waited and exits 7.
"""

from __future__ import annotations

import sys
import time

import torch

from fittrain import Accelerator

STALL_EXIT_CODE = 7


def main(mode: str) -> int:
    accelerator = Accelerator()
    if mode == "raise":
        if accelerator.process_index == 1:
            time.sleep(1.0)  # let rank 0 settle into the barrier first
            print(f"rank 1 raises at {time.time():.3f}", flush=True)
            raise RuntimeError("rank 1 fails on purpose")
        accelerator.wait_for_everyone()
        print("rank 0 passed a barrier that rank 1 never reached", flush=True)
        return 0
    if accelerator.process_index == 1:
        time.sleep(600)  # alive, but absent from the collective; the launcher stops us
        return 0
    started = time.monotonic()
    try:
        accelerator.reduce(torch.ones(1))
    except RuntimeError as error:
        print(f"collective failed after {time.monotonic() - started:.1f}s, at {time.time():.3f}: {error}",
              flush=True)
        return STALL_EXIT_CODE
    print("the collective completed without rank 1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
