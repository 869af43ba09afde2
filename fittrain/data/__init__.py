"""Prepared data sources: this rank's batches, on the device, in an order a checkpoint can resume.

`Accelerator.prepare` (its `prepare_data_loader`, and Accelerate's `prepare_data_loader` function
in `fittrain.accelerator.prepare_data`) turns what the user passes into one `PositionedSource`:

    DataLoader over a map-style dataset  -> map_style.DataLoaderShard   (index batches dealt to ranks)
    DataLoader over an IterableDataset   -> streams.StreamShard         (a share of every round per rank)
    list of ready batches                -> batches.BatchesShard        (batches dealt to ranks)

Every source keeps a `DataPosition` (epoch, batches consumed) and a `state_dict()` with what its
pass needs to continue (the RNG state its order was drawn from, a stream's per-worker progress),
which checkpoints save per rank. One pass is one epoch; `iterate(skip=n)` continues an epoch
after n batches without loading them (`skip_first_batches`).

Modules:
    position        DataPosition, PositionedSource: the per-batch bookkeeping
    map_style       DataLoaderShard
    order           EpochOrder: the user's order, drawn as torch draws it, shared by ranks, replayed on resume
    seedable        use_seedable_sampler: an order from data_seed + epoch
    dealing         SampleDealer, BatchDealer: an epoch's batches dealt to ranks
    streams         StreamShard: worker order, look-ahead, pass state
    stream_workers  RankStream: the rounds read in each worker
    stream_state    which streams resume from their own state
    batches         BatchesShard
    skipping        skip_first_batches, SkippedDataLoader; check_skip_count, the one check of a skip count
    workers         per-batch seeding in DataLoader workers
    devices         send_to_device, batch_size_of

May import: `distributed` (the gradient state, preemption signals) and `common`. Never the
Accelerator, the Trainer or `checkpoint`: they build on this package.
"""

from fittrain.data.batches import BatchesShard, check_batches
from fittrain.data.devices import batch_size_of, send_to_device
from fittrain.data.map_style import DataLoaderShard
from fittrain.data.position import DataPosition, PositionedSource
from fittrain.data.seedable import SeedableRandomSampler
from fittrain.data.skipping import SkippedDataLoader, check_skip_count, skip_first_batches
from fittrain.data.streams import StreamShard

__all__ = ["BatchesShard", "DataLoaderShard", "DataPosition", "PositionedSource", "SeedableRandomSampler",
           "SkippedDataLoader", "StreamShard", "batch_size_of", "check_batches", "check_skip_count",
           "send_to_device", "skip_first_batches"]
