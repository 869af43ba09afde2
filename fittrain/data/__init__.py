"""Prepared data sources: this rank's batches, on the device, in an order a checkpoint can resume.

`Accelerator.prepare` turns what the user passes into one `PositionedSource`:

    DataLoader over a map-style dataset  -> map_style.DataLoaderShard   (index batches dealt to ranks)
    list of ready batches                -> batches.BatchesShard        (batches dealt to ranks)

Every source keeps a `DataPosition` (epoch, batches consumed, shuffle seed) that checkpoints save,
and yields one epoch per pass; `iterate(skip=n)` continues an epoch after n batches without
loading them (`skipping.SkippedDataLoader` is Accelerate's `skip_first_batches`).

Modules: position (DataPosition, PositionedSource: the per-batch bookkeeping); map_style
(DataLoaderShard); batches (BatchesShard); skipping (SkippedDataLoader); workers (per-batch
seeding in DataLoader workers); devices (send_to_device, batch_size_of).
"""

from .batches import BatchesShard, check_batches
from .devices import batch_size_of, send_to_device
from .map_style import DataLoaderShard
from .position import DataPosition, PositionedSource
from .skipping import SkippedDataLoader

__all__ = ["BatchesShard", "DataLoaderShard", "DataPosition", "PositionedSource", "SkippedDataLoader",
           "batch_size_of", "check_batches", "send_to_device"]
