"""The Accelerator layer: Hugging Face Accelerate's vocabulary over torch.distributed.

Holds:
    accelerator      the `Accelerator` facade
    checkpointing    save_state / load_state / save_model / register_for_checkpointing
    tracking         init_trackers / log / get_tracker
    compat           Accelerate's methods that scripts call and fittrain's loop does not need
    configuration    Accelerate's configuration objects (`DataLoaderConfiguration`, the kwargs handlers)
    partial_state    `PartialState` and `AcceleratorState`
    process_logging  `get_logger` (public as `fittrain.logging`)
    prepare_data     `prepare_data_loader` without an Accelerator object

May import: `step`, `data`, `checkpoint`, `trackers`, `distributed`, `common`.
"""

from fittrain.accelerator.accelerator import Accelerator

__all__ = ["Accelerator"]
