"""`lightning.pytorch.strategies`' `DDPStrategy` and `FSDPStrategy`, as the Trainer's `strategy=`.

fittrain writes no engine of its own: a strategy object only says which torch.distributed layout
the Accelerator builds and with which arguments, as the strings "ddp" and "fsdp" do.

- `DDPStrategy(find_unused_parameters=..., static_graph=..., ...)`: DDP's own keyword arguments go to
  `DistributedDataParallel` (through `fittrain.DistributedDataParallelKwargs`); `process_group_backend`
  and `timeout` to the process group (`InitProcessGroupKwargs`).
- `FSDPStrategy()`: FSDP2 (`fully_shard`), with `process_group_backend` and `timeout`. Its FSDP1
  options (wrapping policies, sharding strategies, CPU offload, ...) are refused, naming fittrain's way.

Processes are started by `fittrain launch` (or torchrun), never by the strategy, so the options
about starting them (`start_method`, `parallel_devices`, `cluster_environment`) are refused too.
Lightning's other strategies (DeepSpeedStrategy, ...) can be imported; building one raises (missing.py).
"""

from __future__ import annotations

import datetime
from typing import Any

from fittrain.accelerator.configuration import DistributedDataParallelKwargs, InitProcessGroupKwargs
from fittrain.common.reprs import short_repr
from fittrain.lightning.missing import STRATEGIES, missing

#: DDP's keyword arguments that DDPStrategy passes on (DistributedDataParallelKwargs' fields).
_DDP_OPTIONS = ("broadcast_buffers", "bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view",
                "static_graph", "dim", "check_reduction")
#: Options of Lightning's strategies that fittrain does not take, and what to do instead.
_REFUSED = {
    "accelerator": "pass Trainer(accelerator=...)",
    "parallel_devices": "pass Trainer(devices=...) and start the processes with `fittrain launch`",
    "cluster_environment": "fittrain reads torchrun's and SLURM's variables itself",
    "checkpoint_io": "checkpoints are fittrain's atomic, verified folders",
    "precision_plugin": "pass Trainer(precision=...)",
    "precision": "pass Trainer(precision=...)",
    "ddp_comm_state": "pass fittrain.DistributedDataParallelKwargs(comm_hook=..., comm_state_option=...) to an "
                      "Accelerator of your own",
    "ddp_comm_hook": "use fittrain.DistributedDataParallelKwargs(comm_hook='fp16' | 'bf16' | 'power_sgd')",
    "ddp_comm_wrapper": "use fittrain.DistributedDataParallelKwargs(comm_wrapper=...)",
    "model_averaging_period": "use fittrain.local_sgd.LocalSGD in an Accelerator loop",
    "auto_wrap_policy": "FSDP2 shards each module holding parameters; to shard by block, give the native Trainer "
                        "accelerator=fittrain.Accelerator(strategy='fsdp', fsdp_classes=[Block])",
    "sharding_strategy": "fittrain shards fully (FSDP2); for hybrid sharding give the native Trainer a "
                         "fittrain.ParallelismConfig",
    "cpu_offload": "not available: FSDP2 keeps parameters on the device",
    "mixed_precision": "pass Trainer(precision='bf16-mixed')",
    "activation_checkpointing_policy": "apply torch.utils.checkpoint in the module's forward",
    "state_dict_type": "fittrain saves sharded checkpoints under FSDP2, and `fittrain consolidate` makes them whole",
    "device_mesh": "give the native Trainer a fittrain.ParallelismConfig",
}


class Strategy:
    """What a Lightning strategy object tells the Trainer: the layout ("ddp" or "fsdp") and the arguments
    of DDP and of the process group.

    Attributes:
        strategy_name: Lightning's name, "ddp" or "fsdp".
        ddp_options: Keyword arguments for DistributedDataParallel.
        process_group_backend: "gloo", "nccl" or None (fittrain's choice: nccl on CUDA, else gloo).
        timeout: How long a collective waits for the other processes (None: torch's default).
    """

    strategy_name = ""

    def __init__(self, options: dict[str, Any], process_group_backend: str | None,
                 timeout: datetime.timedelta | None) -> None:
        kind = type(self).__name__
        for name, value in options.items():
            if name in _REFUSED and value is not None:
                raise ValueError(f"{kind}({name}={short_repr(value)}) is not supported by fittrain.lightning. "
                                 f"Instead: {_REFUSED[name]}.")
        self.ddp_options = {k: v for k, v in options.items() if k not in _REFUSED}
        # Built here, so that a bad value is refused where the strategy is made, naming its field.
        self._process_group = InitProcessGroupKwargs(backend=process_group_backend, timeout=timeout)
        self.process_group_backend, self.timeout = process_group_backend, timeout

    def kwargs_handlers(self) -> list[Any]:
        """The Accelerator's kwargs handlers that carry this strategy's arguments."""
        handlers: list[Any] = [DistributedDataParallelKwargs(**self.ddp_options)] if self.ddp_options else []
        if self.process_group_backend is not None or self.timeout is not None:
            handlers.append(self._process_group)
        return handlers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.ddp_options.items())})"


class ParallelStrategy(Strategy):
    """Lightning's base class of the strategies of several processes: DDPStrategy and FSDPStrategy."""


class DDPStrategy(ParallelStrategy):
    """Lightning's `DDPStrategy`: DistributedDataParallel with its keyword arguments (`find_unused_parameters`,
    `static_graph`, `gradient_as_bucket_view`, `broadcast_buffers`, `bucket_cap_mb`).

    Raises:
        ValueError: for an option fittrain does not take (see the module docstring) or a bad value.
        TypeError: for a keyword DistributedDataParallel does not take.
    """

    strategy_name = "ddp"

    def __init__(self, accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, ddp_comm_state: Any = None,
                 ddp_comm_hook: Any = None, ddp_comm_wrapper: Any = None, model_averaging_period: Any = None,
                 process_group_backend: str | None = None, timeout: datetime.timedelta | None = None,
                 start_method: str = "popen", **kwargs: Any) -> None:
        if start_method != "popen":
            raise ValueError(f"DDPStrategy(start_method={short_repr(start_method)}) is not supported by "
                             "fittrain.lightning: fittrain does not start processes. Run `fittrain launch "
                             "--num_processes N program.py` (or torchrun) with the default start_method.")
        unknown = sorted(set(kwargs) - set(_DDP_OPTIONS))
        if unknown:
            raise TypeError(f"DDPStrategy({unknown[0]}=...): DistributedDataParallel takes no such argument. Its "
                            f"options here: {', '.join(_DDP_OPTIONS)}.")
        DistributedDataParallelKwargs(**kwargs)  # checks each value's type at once
        given = dict(accelerator=accelerator, parallel_devices=parallel_devices,
                     cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                     precision_plugin=precision_plugin, ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook,
                     ddp_comm_wrapper=ddp_comm_wrapper, model_averaging_period=model_averaging_period)
        super().__init__({**given, **kwargs}, process_group_backend, timeout)


class FSDPStrategy(ParallelStrategy):
    """Lightning's `FSDPStrategy`, as FSDP2 with its defaults: only `process_group_backend` and `timeout`
    are taken; Lightning's FSDP1 options are refused, naming fittrain's way.

    Raises:
        ValueError: for an FSDP1 option, or another keyword.
    """

    strategy_name = "fsdp"

    def __init__(self, process_group_backend: str | None = None, timeout: datetime.timedelta | None = None,
                 **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if name not in _REFUSED:
                raise ValueError(f"FSDPStrategy({name}={short_repr(value)}) is not supported by fittrain.lightning, "
                                 "which runs FSDP2 with its defaults. Pass strategy='fsdp', or give the native "
                                 "Trainer an accelerator=fittrain.Accelerator(strategy='fsdp', ...) for its options.")
        super().__init__(kwargs, process_group_backend, timeout)
        self.ddp_options = {}  # FSDP2 takes no DDP arguments


__all__ = ["DDPStrategy", "FSDPStrategy", "ParallelStrategy", "Strategy"]


# Lightning's other strategies: importable, and refused where built, naming the fittrain way (missing.py).
globals().update(missing(STRATEGIES, __name__))
