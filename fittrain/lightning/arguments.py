"""Lightning's Trainer arguments, checked and turned into fittrain's: the processes and devices,
the precision, the loop limits, and the arguments fittrain.lightning refuses (each with the
fittrain way).

Processes: Lightning starts its own processes for `devices=N`; fittrain does not. A program runs on
N processes under `fittrain launch --num_processes N program.py` (or torchrun), and its
`Trainer(devices=N, num_nodes=M, strategy="ddp")` must then describe that job: `devices` the
processes on each machine, `num_nodes` the machines. `devices` of 1, "auto" or -1 describe any job.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from fittrain.accelerator.configuration import DistributedDataParallelKwargs
from fittrain.common.reprs import short_repr
from fittrain.lightning.strategies import Strategy

#: Trainer arguments fittrain.lightning takes only at Lightning's default -> (default, the fittrain way).
REFUSED: dict[str, tuple[Any, str]] = {
    "profiler": (None, "profile with `trainer.accelerator.profile()` (torch.profiler) around the code"),
    "plugins": (None, "fittrain has no plugins: precision is `precision=`, environments are torchrun's"),
    "reload_dataloaders_every_n_epochs": (0, "build a loader that changes per epoch (a sampler with set_epoch)"),
    "use_distributed_sampler": (True, "fittrain always shards each loader by process; pass the plain loader"),
    "model_registry": (None, "the Lightning model registry is not available; save with ModelCheckpoint"),
}

_PRECISIONS = {None: "no", "32-true": "no", "32": "no", 32: "no", "16-mixed": "fp16", "16": "fp16", 16: "fp16",
               "bf16-mixed": "bf16", "bf16": "bf16"}
_STRATEGIES = {"auto": "auto", "ddp": "ddp", "fsdp": "fsdp", "ddp_find_unused_parameters_true": "ddp",
               "ddp_find_unused_parameters_false": "ddp"}
_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


def refuse(argument: str, value: Any, fix: str) -> None:
    """Raises the error for a Lightning argument fittrain.lightning does not support.

    Raises:
        ValueError: naming the argument, the value and the fittrain way.
    """
    raise ValueError(f"Trainer({argument}={short_repr(value)}) is not supported by fittrain.lightning. "
                     f"Instead: {fix}.")


def check_refused(arguments: dict[str, Any]) -> None:
    """Refuses every argument of `REFUSED` given at another value than Lightning's default."""
    for name, (default, fix) in REFUSED.items():
        value = arguments[name]
        if value is not default and value != default:
            refuse(name, value, fix)


def precision_of(precision: Any, on_cpu: bool) -> str:
    """Lightning's `precision` as the MixedPrecision callback's: "no", "fp16" or "bf16".

    Raises:
        ValueError: for another precision ("64-true", "bf16-true", ...), and for fp16 on the CPU, which
            Lightning refuses too.
    """
    try:
        mixed = _PRECISIONS[precision]
    except (KeyError, TypeError):
        refuse("precision", precision, "use '32-true' (the default), '16-mixed' or 'bf16-mixed'; for other "
               "dtypes, convert the module yourself (module.double(), module.to(torch.bfloat16))")
    if mixed == "fp16" and on_cpu:
        refuse("precision", precision, "fp16 mixed precision needs a GPU (Lightning refuses it on the CPU too); "
               "use precision='bf16-mixed' on the CPU")
    return mixed


@dataclasses.dataclass(frozen=True)
class Processes:
    """The job a Trainer's `accelerator`, `strategy`, `devices` and `num_nodes` describe.

    Attributes:
        strategy: The native strategy: "auto", "ddp" or "fsdp".
        cpu: Train on the CPU even where a GPU is.
        kwargs_handlers: The Accelerator's handlers a strategy asks for: DDP's arguments
            ("ddp_find_unused_parameters_true", `DDPStrategy(...)`), the process group's.
        num_devices: The processes on this machine.
        num_nodes: The machines.
    """

    strategy: str
    cpu: bool
    kwargs_handlers: tuple[Any, ...]
    num_devices: int
    num_nodes: int


def processes(accelerator: Any, strategy: Any, devices: Any, num_nodes: Any) -> Processes:
    """Checks the process arguments against the job torchrun (or `fittrain launch`) started.

    Raises:
        ValueError: for an accelerator, strategy or device list fittrain does not run, and for
            `devices`/`num_nodes` that do not match the processes started.
    """
    if not isinstance(accelerator, str) or accelerator not in _ACCELERATORS:
        refuse("accelerator", accelerator, "use 'auto', 'cpu', 'gpu' or 'cuda'")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"Trainer(accelerator={accelerator!r}): no CUDA device is available on this machine. Use "
                         "accelerator='cpu' or 'auto'.")
    handlers = strategy.kwargs_handlers() if isinstance(strategy, Strategy) else []
    strategy = strategy.strategy_name if isinstance(strategy, Strategy) else strategy
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        refuse("strategy", strategy, "use 'auto', 'ddp', 'ddp_find_unused_parameters_true', 'fsdp', DDPStrategy(...) "
               "or FSDPStrategy() (fittrain.lightning.strategies), and start the processes with `fittrain launch "
               "--num_processes N program.py` (or torchrun)")
    if strategy == "ddp_find_unused_parameters_true":
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)]
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"Trainer(num_nodes=...) must be a positive int. Received: num_nodes={short_repr(num_nodes)}.")
    nodes = max(world // max(per_node, 1), 1)
    if num_nodes != nodes:
        raise ValueError(f"Trainer(num_nodes={num_nodes}) does not match this job, which runs on {nodes} machine(s). "
                         f"fittrain does not start processes: run `fittrain launch --num_machines {num_nodes} "
                         "--num_processes <total> ...` on each machine (or torchrun --nnodes), or pass the number of "
                         "machines the job has.")
    _check_devices(devices, per_node)
    return Processes(_STRATEGIES[strategy], accelerator == "cpu", tuple(handlers), per_node, nodes)


def _check_devices(devices: Any, per_node: int) -> None:
    if devices in ("auto", -1, "-1"):
        return
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)) and list(devices) == list(range(len(devices))):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        refuse("devices", devices, "pass the number of processes on each machine (an int), 'auto' or -1; choose "
               "the GPUs with CUDA_VISIBLE_DEVICES or `fittrain launch --gpu_ids`")
    if devices != per_node and not (devices == 1 and per_node == 1):
        raise ValueError(f"Trainer(devices={devices}) does not match the {per_node} process(es) started on this "
                         f"machine. fittrain does not start processes itself: run `fittrain launch --num_processes "
                         f"{devices} program.py` (or `torchrun --nproc_per_node {devices} program.py`), or pass "
                         "devices='auto'.")


def loop_limits(max_epochs: Any, max_steps: Any, max_time: Any) -> tuple[int | None, int | None]:
    """Lightning's limits as the native Trainer's (None: no limit).

    With neither `max_epochs` nor `max_steps` (nor `max_time`), Lightning trains 1000 epochs; with only
    `max_steps` or `max_time`, epochs are unlimited; -1 means unlimited.

    Raises:
        ValueError: for a limit that is neither -1 nor a positive int (None for max_epochs).
    """
    for name, value in (("max_epochs", max_epochs), ("max_steps", max_steps)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1 or value == 0
                                  and name == "max_steps"):
            raise ValueError(f"Trainer({name}=...) must be a positive int or -1 (no limit). Received: "
                             f"{name}={short_repr(value)}.")
    steps = None if max_steps in (None, -1) else max_steps
    if max_epochs is None:
        epochs = 1000 if steps is None and max_time is None else None
    else:
        epochs = None if max_epochs == -1 else max_epochs
    return epochs, steps


def check_minimum(name: str, value: Any) -> int:
    """`min_epochs` or `min_steps` as an int (None: 0).

    Raises:
        ValueError: for a negative or non-int value.
    """
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Trainer({name}=...) must be a non-negative int or None. Received: {name}="
                         f"{short_repr(value)}.")
    return value


def check_flag(name: str, value: Any, allowed: tuple[Any, ...] = (None, True, False)) -> Any:
    """Returns `value` when it is one of `allowed`.

    Raises:
        ValueError: naming the argument and the values allowed.
    """
    if not any(value is choice for choice in allowed):
        raise ValueError(f"Trainer({name}=...) must be one of {', '.join(map(repr, allowed))}. Received: "
                         f"{name}={short_repr(value)}.")
    return value


def opt_out_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """Lightning's defaults for the features `barebones=True` switches off (and refuses switched on).

    Raises:
        ValueError: for barebones=True with one of them on, as in Lightning.
    """
    names = {"enable_checkpointing": True, "logger": True, "enable_progress_bar": True, "log_every_n_steps": 50,
             "enable_model_summary": True, "num_sanity_val_steps": 2}
    if not given["barebones"]:
        return {name: default if given[name] is None else given[name] for name, default in names.items()}
    off = {"enable_checkpointing": False, "logger": False, "enable_progress_bar": False, "log_every_n_steps": 0,
           "enable_model_summary": False, "num_sanity_val_steps": 0}
    for name, value in off.items():
        if given[name] is not None and given[name] != value:
            raise ValueError(f"`Trainer(barebones=True, {name}={given[name]!r})` was passed. barebones=True switches "
                             f"{name} off (it costs raw speed). Remove one of them.")
    for name in ("fast_dev_run", "detect_anomaly"):
        if given[name]:
            raise ValueError(f"`Trainer(barebones=True, {name}={given[name]!r})` was passed; barebones=True leaves "
                             f"{name} off. Remove one of them.")
    return off


def gradient_clipping(value: Any, algorithm: Any) -> tuple[float | None, str | None]:
    """(clip value or None, "norm" or "value") from Lightning's `gradient_clip_val`/`gradient_clip_algorithm`.

    Raises:
        TypeError: for a value that is not a number.
        ValueError: for an algorithm other than "norm" or "value", or a negative value.
    """
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise TypeError(f"`gradient_clip_val` should be an int or a float. Got {short_repr(value)}.")
    if algorithm is not None and (not isinstance(algorithm, str) or algorithm.lower() not in ("norm", "value")):
        raise ValueError(f"`gradient_clip_algorithm` {short_repr(algorithm)} is invalid. Allowed algorithms: "
                         "'norm', 'value'.")
    if value is not None and value < 0:
        raise ValueError(f"`gradient_clip_val` must be at least 0. Received: {value}.")
    return (float(value) if value else None), (algorithm.lower() if algorithm else "norm")


def check_clipping(module: Any, clip: float | None) -> None:
    """Refuses Trainer clipping in manual optimization, as Lightning does.

    Raises:
        ValueError: naming the way (`self.clip_gradients` in training_step).
    """
    if clip and not module.automatic_optimization:
        raise ValueError(f"Automatic gradient clipping is not supported for manual optimization. Remove "
                         f"`Trainer(gradient_clip_val={clip})` and clip in training_step with "
                         "self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm=...).")


def check_strict_loading(module: Any, stage: str, ckpt_path: Any) -> None:
    """Refuses `strict_loading=False` where a stage restores a checkpoint: fittrain restores a training
    state whole or not at all, and a Lightning program relying on a partial restore would otherwise
    fail later, or train from a state it did not expect.

    Raises:
        ValueError: naming `load_from_checkpoint(strict=False)` as the way.
    """
    if ckpt_path is not None and getattr(module, "strict_loading", True) is False:
        raise ValueError(f"Trainer.{stage}(ckpt_path={short_repr(ckpt_path)}) with {type(module).__name__}."
                         "strict_loading=False: fittrain restores a checkpoint whole, every key matching. Load the "
                         "weights with Module.load_from_checkpoint(path, strict=False) and pass that module "
                         "without ckpt_path.")


def validation_interval(val_check_interval: Any, check_val_every_n_epoch: Any,
                        accumulate_grad_batches: int = 1) -> tuple[int | None, int | float | None]:
    """(val_every_n_epochs, val_every_n_steps) of the native Trainer for Lightning's pair.

    Lightning's int `val_check_interval` counts training batches (within each validated epoch, or over
    the whole fit when `check_val_every_n_epoch` is None); a float is a fraction of the epoch.

    Raises:
        ValueError: for a combination Lightning refuses, or an int interval that does not fall on an
            optimizer step under gradient accumulation (fittrain validates right after a step).
    """
    if check_val_every_n_epoch is not None and (not isinstance(check_val_every_n_epoch, int)
                                                or isinstance(check_val_every_n_epoch, bool)
                                                or check_val_every_n_epoch < 1):
        raise ValueError(f"`check_val_every_n_epoch` should be a positive int or None. Got "
                         f"{short_repr(check_val_every_n_epoch)}.")
    interval = 1.0 if val_check_interval is None else val_check_interval
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        refuse("val_check_interval", interval, "pass an int (training batches) or a float in (0, 1] (a fraction "
               "of the epoch); time intervals are not supported, use max_time to stop after a time")
    if check_val_every_n_epoch is None and not isinstance(interval, int):
        raise ValueError(f"`val_check_interval` should be an integer when `check_val_every_n_epoch=None`, found "
                         f"{interval!r}.")
    if isinstance(interval, float):
        if not 0.0 < interval <= 1.0:
            raise ValueError(f"`val_check_interval` should be within (0, 1] as a float. Got {interval}.")
        if interval == 1.0:
            return check_val_every_n_epoch, None
        return check_val_every_n_epoch, interval
    if interval < 1:
        raise ValueError(f"`val_check_interval` should be a positive int. Got {interval}.")
    if interval % accumulate_grad_batches:
        refuse("val_check_interval", interval, f"with accumulate_grad_batches={accumulate_grad_batches}, pass a "
               "multiple of it: fittrain validates right after an optimizer step")
    return check_val_every_n_epoch, interval // accumulate_grad_batches


def check_loaders(name: str, loaders: Any) -> None:
    """Refuses several loaders (a list, tuple or dict of DataLoaders): fittrain runs one loader per loop.

    Raises:
        ValueError: naming the argument and the fittrain way.
    """
    from torch.utils.data import DataLoader  # torch is imported already; kept local to this check

    items = list(loaders.values()) if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) \
        else []
    if any(isinstance(item, DataLoader) for item in items):
        refuse(name, loaders, "pass one DataLoader; several loaders per loop (dataloader_idx, CombinedLoader) are "
               "not supported: concatenate their datasets, or call validate/test once per loader")


def apply_benchmark(benchmark: Any) -> None:
    """Sets `torch.backends.cudnn.benchmark` as Lightning does (None leaves it as it is)."""
    check_flag("benchmark", benchmark)
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark
