"""`ParallelismConfig`: how a run lays its processes out on a device mesh, in Accelerate's names.

`Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))` and
`Trainer(parallelism_config=...)` take it. The sizes multiply to the number of processes, and
pick the strategy (`fittrain.distributed.strategies`), so nothing else needs naming:

- `dp_shard_size > 1`: FSDP2 shards every parameter over `dp_shard_size` processes; with
  `dp_replicate_size > 1` too, that is HSDP: FSDP2 over a (dp_replicate, dp_shard) mesh, each
  replica group holding whole copies of the shards and averaging gradients with the others.
- `dp_replicate_size > 1` alone: plain data parallelism (DDP). Accelerate refuses this layout and
  points to DDP; fittrain simply runs DDP.
- `tp_size > 1`: tensor parallelism from the model's `tp_plan` over the innermost "tp" dimension,
  applied before FSDP2 wraps (torchtitan's order); with `dp_shard_size`/`dp_replicate_size`, FSDP2
  (or HSDP) then shards or replicates over the data-parallel dimensions
  (`fittrain.distributed.strategies.tensor_parallel`).
- `cp_size > 1` (context parallelism) needs CUDA attention kernels: refused by name at `Accelerator(...)`.

Processes are numbered row-major over (dp_replicate, dp_shard, tp): the `tp_size` consecutive
ranks of a tensor-parallel group share one data-parallel rank, `process_index // tp_size`, and see
the same batches. Loaders are dealt by data-parallel rank, so exact resume and elastic resume work
as under DDP and FSDP2, and checkpoints (full, or DCP's sharded ones, which reshard on load) load
into any other layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fittrain.common.reprs import short_repr

#: The mesh dimensions, outermost first (Accelerate's and torchtitan's names).
REPLICATE_DIM, SHARD_DIM, TP_DIM = "dp_replicate", "dp_shard", "tp"
_SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")


@dataclasses.dataclass
class ParallelismConfig:
    """A run's layout: data-parallel replication and sharding, tensor parallelism (and, reserved,
    context parallelism). A size left at None is 1.

    Args:
        dp_replicate_size: Groups holding whole copies of the model (or of its shards, with sharding).
        dp_shard_size: Processes that shard every parameter between them (FSDP2).
        tp_size: Tensor-parallel processes: each parallelized layer's weights are split between them,
            as the model's `tp_plan` says.
        cp_size: Context-parallel processes; only 1 is supported (it needs CUDA attention kernels).
        tp_handler: Accelerate's `TorchTensorParallelConfig`; accepted without async TP, which needs
            CUDA's symmetric memory (`enable_async_tp=True` is refused).
        cp_handler: Accelerate's `TorchContextParallelConfig`; only None is accepted.

    Raises:
        ValueError: for a size that is not a positive integer (the others are checked against the
            number of processes by the Accelerator, on every process).
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    tp_handler: Any = None
    cp_handler: Any = None

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if value is None:
                setattr(self, name, 1)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}=...) must be a positive integer (or None for 1). "
                                 f"Received: {name}={short_repr(value)}.")

    @property
    def total_size(self) -> int:
        """The number of processes the layout needs: the product of the sizes."""
        return self.dp_replicate_size * self.dp_shard_size * self.tp_size * self.cp_size

    @property
    def data_parallel_size(self) -> int:
        """Processes that each see their own batches: replication times sharding."""
        return self.dp_replicate_size * self.dp_shard_size

    def data_parallel_rank(self, process_index: int) -> int:
        """The data-parallel rank of process `process_index`: the ranks of one tensor-parallel group
        (consecutive, since tp is the innermost dimension) share it."""
        return process_index // (self.tp_size * self.cp_size)

    def repeats_batches(self, process_index: int) -> bool:
        """Whether process `process_index` sees the batches of another one: it is not the first of its
        tensor-parallel group (what `gather_for_metrics` gathers from it once)."""
        return process_index % (self.tp_size * self.cp_size) != 0

    @property
    def strategy(self) -> str:
        """The strategy name this layout runs: "fsdp" (FSDP2 or HSDP), "ddp", or "auto" (one process)."""
        if self.dp_shard_size > 1:
            return "fsdp"
        return "ddp" if self.dp_replicate_size > 1 else "auto"

    @property
    def fsdp_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """FSDP2's mesh (shape, dimension names): 2-D (replicate, shard) for HSDP (and for replication
        beside tensor parallelism, with a shard size of 1), else 1-D."""
        if self.dp_replicate_size > 1:
            return (self.dp_replicate_size, self.dp_shard_size), (REPLICATE_DIM, SHARD_DIM)
        return (self.dp_shard_size,), (SHARD_DIM,)

    def check(self, num_processes: int, strategy: str) -> None:
        """Checks the layout against the run, as every process does at `Accelerator(...)`.

        Args:
            num_processes: The run's number of processes.
            strategy: The `strategy=` the Accelerator was given ("auto" leaves the choice to the layout).

        Raises:
            ValueError: for sizes that do not multiply to `num_processes`, a layout fittrain cannot
                run (context parallelism, async TP), or a `strategy` that contradicts it.
        """
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in _SIZES)
        if self.cp_size > 1 or self.cp_handler is not None:
            raise ValueError(
                f"ParallelismConfig(cp_size={self.cp_size}): context parallelism needs CUDA attention kernels "
                "(ring attention over SDPA's flash or efficient kernels), which fittrain does not drive yet, and "
                f"which a CPU run cannot use. Received: {sizes}. Use cp_size=1 and shard with dp_shard_size.")
        if getattr(self.tp_handler, "enable_async_tp", False):
            raise ValueError(
                "ParallelismConfig(tp_handler=TorchTensorParallelConfig(enable_async_tp=True)): async tensor "
                "parallelism overlaps its collectives through CUDA symmetric memory, which fittrain does not drive. "
                f"Received: {sizes}, enable_async_tp=True. Leave enable_async_tp=False (or tp_handler=None).")
        if self.total_size != num_processes:
            raise ValueError(
                f"ParallelismConfig's sizes multiply to {self.total_size} processes, but this run has "
                f"{num_processes}. Received: {sizes}. Make dp_replicate_size x dp_shard_size x tp_size x cp_size "
                f"equal the number of processes (fittrain launch --num_processes {self.total_size}, or other sizes).")
        if strategy not in ("auto", self.strategy):
            raise ValueError(
                f"strategy={strategy!r} contradicts the parallelism_config, whose sizes run {self.strategy!r}. "
                f"Received: strategy={strategy!r}, {sizes}. Leave strategy at 'auto' with a parallelism_config.")


def check_layout_type(value: Any) -> ParallelismConfig | None:
    """`parallelism_config` as given: a ParallelismConfig, Accelerate's own (same fields), or None.

    Raises:
        TypeError: for anything else.
        ValueError: for Accelerate's sequence parallelism (`sp_size > 1`, DeepSpeed's Ulysses).
    """
    if value is None or isinstance(value, ParallelismConfig):
        return value
    if type(value).__name__ == "ParallelismConfig" and all(hasattr(value, name) for name in _SIZES):
        sp_size = getattr(value, "sp_size", 1) or 1
        if sp_size > 1:
            raise ValueError(f"parallelism_config=accelerate.ParallelismConfig(sp_size={sp_size}): sequence "
                             "parallelism is DeepSpeed's Ulysses in Accelerate, which fittrain does not run. Received: "
                             f"sp_size={sp_size}. Use sp_size=1 (tensor parallelism: tp_size).")
        # `from accelerate import ParallelismConfig` left in a ported script: the same layout.
        return ParallelismConfig(**{name: getattr(value, name) for name in _SIZES},
                                 tp_handler=getattr(value, "tp_handler", None),
                                 cp_handler=getattr(value, "cp_handler", None))
    raise TypeError(f"parallelism_config must be a fittrain.ParallelismConfig (or None). Received: "
                    f"{short_repr(value)} ({type(value).__name__}). Build one: "
                    "ParallelismConfig(dp_replicate_size=..., dp_shard_size=...).")
