"""The smallest job: each rank joins the group, passes a barrier and prints `rank R ok`."""

from __future__ import annotations

from fittrain import Accelerator

if __name__ == "__main__":
    accelerator = Accelerator()
    accelerator.wait_for_everyone()
    print(f"rank {accelerator.process_index} ok", flush=True)
    accelerator.end_training()
