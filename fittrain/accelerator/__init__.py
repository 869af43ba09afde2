"""The Accelerator layer: Hugging Face Accelerate's vocabulary over torch.distributed.

Holds:
    accelerator      the `Accelerator` facade; it owns a strategy (`fittrain.distributed.strategies`),
                     `PreparedObjects`, a `Checkpointing` and a `Tracking` object, and delegates to them
    prepared         `PreparedObjects`: the models, optimizers, schedulers and loaders it prepared
    checkpointing    `Checkpointing`: save_state / load_state / save_model / register_for_checkpointing
    tracking         `Tracking`: init_trackers / log / get_tracker
    loaders          preparing one data loader (sharding, placement, checks across processes)
    compat           `CompatMethods`: Accelerate's methods fittrain's loop does not need, on public attributes
    configuration    Accelerate's configuration objects (`DataLoaderConfiguration`, the kwargs handlers)
    launch_env       the environment `fittrain launch` exports and the Accelerator reads as defaults
    partial_state    `PartialState` and `AcceleratorState`
    process_logging  `get_logger` (public as `fittrain.logging`)
    prepare_data     `prepare_data_loader` without an Accelerator object
    seeding          `set_seed` (public in `fittrain.utils`) and Lightning's `seed_everything` (`fittrain`)

May import: `step`, `data`, `checkpoint`, `trackers`, `distributed`, `common` (never `trainer`,
`launch` or `callbacks`).
"""

from fittrain.accelerator.accelerator import Accelerator

__all__ = ["Accelerator"]
