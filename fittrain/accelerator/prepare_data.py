"""`prepare_data_loader(...)`: Accelerate's function that prepares one DataLoader without an Accelerator."""

from __future__ import annotations

from typing import Any

import torch

from fittrain.accelerator.accelerator import Accelerator
from fittrain.accelerator.configuration import DataLoaderConfiguration


def prepare_data_loader(dataloader: Any, device: torch.device | str | None = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> Any:
    """Prepares `dataloader` for this process as `Accelerator.prepare` does (Accelerate's function).

    The processes are those of the running process group: `num_processes` and `process_index`,
    when given, must match it.

    Raises:
        ValueError: for a process layout that is not the group's, or an option fittrain does not
            have (`slice_fn_for_dispatch`, `torch_device_mesh`, `dispatch_batches=True`).
    """
    for name, value in (("slice_fn_for_dispatch", slice_fn_for_dispatch), ("torch_device_mesh", torch_device_mesh)):
        if value is not None:
            raise ValueError(f"prepare_data_loader({name}=...) is not supported: every fittrain process reads its own "
                             f"share, with no dispatching and no device mesh. Received: {name}={value!r:.60}.")
    config = DataLoaderConfiguration(split_batches=split_batches, dispatch_batches=dispatch_batches,
                                     even_batches=even_batches, use_seedable_sampler=use_seedable_sampler,
                                     data_seed=data_seed, non_blocking=non_blocking,
                                     use_stateful_dataloader=use_stateful_dataloader)
    cpu = device is not None and torch.device(device).type == "cpu"
    accelerator = Accelerator(cpu=cpu, dataloader_config=config, rng_types=rng_types)
    for name, value, actual in (("num_processes", num_processes, accelerator.num_processes),
                                ("process_index", process_index, accelerator.process_index)):
        if value is not None and value != actual:
            raise ValueError(f"prepare_data_loader({name}={value}) does not match the process group, where it is "
                             f"{actual}: fittrain shards for the processes that run. Leave it out or pass {actual}.")
    return accelerator.prepare_data_loader(dataloader, device_placement=put_on_device)
