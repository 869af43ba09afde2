"""Accelerate's launch options and config files, for `fittrain launch`.

`fittrain launch` takes the flags users have in their `accelerate launch` lines, and
`--config_file` reads the YAML (or JSON) file that `accelerate config` writes. A flag given on the
command line wins over the file, as in Accelerate. What the workers must know (precision,
accumulation, compile backend, CPU) is exported under Accelerate's own environment variables,
which `fittrain.Accelerator` reads as the defaults of the matching arguments, so a script that
passes nothing picks them up and one that passes a value keeps its own.

Nothing is ignored silently: a config key fittrain does not know, or a value it cannot honour
(DeepSpeed, TPUs, fp8, FSDP options that differ from what FSDP2 does here), is an error naming
the key, the value and what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any, Callable

from fittrain.accelerator.launch_env import (
    ACCUMULATION_ENV,
    DEBUG_ENV,
    DYNAMO_BACKEND_ENV,
    MIXED_PRECISION_ENV,
    USE_CPU_ENV,
)
from fittrain.common.reprs import short_repr
from fittrain.distributed.parallel import STRATEGY_ENV

__all__ = ["ACCUMULATION_ENV", "DEBUG_ENV", "DYNAMO_BACKEND_ENV", "MIXED_PRECISION_ENV", "USE_CPU_ENV",
           "merge", "options_from_config", "read_config_file", "worker_environment"]

# Accelerate's environment variables, read by `fittrain.Accelerator` as argument defaults: the
# contract between the launcher and the workers lives in `fittrain.accelerator.launch_env`.

#: torchrun's rendezvous backends that `fittrain launch --rdzv_backend` offers.
RDZV_BACKENDS = ("static", "c10d")
#: The highest TCP port; `--main_process_port` and the config's `main_process_port` must be 1 to this.
MAX_PORT = 65535
#: What to do about a bad port, said by both the flag's and the config key's error.
PORT_HINT = "Choose a free port such as 29500, or leave it out on one machine and torchrun picks a free one."

# `accelerate launch`'s flags that a config file can also set, each with its config key.
# (`num_machines` and `machine_rank` are the flags' aliases of torchrun's `nnodes` and `node_rank`.)
OVERRIDABLE = ("num_processes", "nnodes", "node_rank", "main_process_ip", "main_process_port",
               "mixed_precision", "gpu_ids", "rdzv_backend", "dynamo_backend", "cpu", "strategy", "debug")

_STRATEGY_OF_TYPE = {"NO": None, "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp"}
# Keys `accelerate config` writes whose only value fittrain can honour is the one given here.
_FIXED = {"compute_environment": "LOCAL_MACHINE", "main_training_function": "main", "downcast_bf16": (False, "no"),
          "tpu_use_cluster": False, "tpu_use_sudo": False, "enable_cpu_affinity": False, "same_network": (True, False),
          "tpu_env": ([], None), "commands": None, "command_file": None, "tpu_name": None, "tpu_zone": None,
          "tpu_vm": None, "deepspeed_config": ({}, None), "megatron_lm_config": ({}, None), "fp8_config": ({}, None),
          "mpirun_config": ({}, None), "parallelism_config": ({}, None)}
# FSDP options of Accelerate's config and the value that matches fittrain's FSDP2 (fully_shard).
_FSDP_AS_FITTRAIN = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                     "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_cpu_ram_efficient_loading": False,
                     "fsdp_activation_checkpointing": False, "fsdp_use_orig_params": True,
                     "fsdp_sync_module_states": True, "fsdp_forward_prefetch": False}
_FSDP_FREE = ("fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch",
              "fsdp_state_dict_type", "fsdp_min_num_params")
_DYNAMO_DEFAULTS = {"dynamo_mode": "default", "dynamo_use_fullgraph": False, "dynamo_use_dynamic": False,
                    "dynamo_use_regional_compilation": False}


def read_config_file(path: str) -> dict[str, Any]:
    """Reads an Accelerate config file (YAML, or JSON by its `.json` suffix) into a dict.

    Raises:
        FileNotFoundError: for a missing file.
        ValueError: for a file that is not a mapping of option names.
        ImportError: for a YAML file when PyYAML is not installed.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`--config_file` names a file that does not exist. Received: --config_file {path!r}. "
                                "Pass the YAML file `accelerate config` wrote (default location: "
                                "~/.cache/huggingface/accelerate/default_config.yaml).")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"`--config_file {path}` is not a text file in UTF-8 ({err.reason} at byte {err.start}). "
                         "Pass the YAML file `accelerate config` wrote.") from None
    config = _parse_json(text, path) if path.endswith(".json") else _parse_yaml(text, path)
    if not isinstance(config, dict):
        raise ValueError(f"`--config_file {path}` must hold a mapping of option names to values, as `accelerate "
                         f"config` writes. Received: {type(config).__name__}.")
    return config


def _parse_json(text: str, path: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(_malformed(path, "JSON", err.msg, err.lineno, err.colno)) from None


def _parse_yaml(text: str, path: str) -> Any:
    try:
        import yaml  # an optional dependency: JSON config files and flags need none
    except ImportError as err:
        raise ImportError("`--config_file` with a YAML file needs PyYAML, which is not installed: run "
                          "`pip install pyyaml`, or pass the same options as flags or a .json file.") from err
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        # PyYAML's own message spans several lines with a quote of the file: keep what and where.
        mark = getattr(err, "problem_mark", None)
        what = ", ".join(str(part) for part in (getattr(err, "context", None), getattr(err, "problem", None)) if part)
        where = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        raise ValueError(_malformed(path, "YAML", what or str(err).splitlines()[0], *where)) from None


def _malformed(path: str, kind: str, problem: str, line: int | None, column: int | None) -> str:
    where = f" at line {line}, column {column}" if line is not None else ""
    return (f"`--config_file {path}` is not valid {kind}: {problem}{where}. Fix the file there, or write it "
            "again with `accelerate config`.")


def options_from_config(config: dict[str, Any], path: str) -> dict[str, Any]:
    """The `fittrain launch` options an Accelerate config stands for, keyed like the flags.

    Raises:
        ValueError: naming the key and value, for a key fittrain does not know or a value it
            cannot honour.
    """
    options: dict[str, Any] = {}
    readers: dict[str, Callable[[Any], None]] = {
        "distributed_type": lambda v: options.update(strategy=_strategy(v, path)),
        "mixed_precision": lambda v: options.update(mixed_precision=v),
        "use_cpu": lambda v: options.update(cpu=_boolean("use_cpu", v, path)),
        "debug": lambda v: options.update(debug=_boolean("debug", v, path)),
        # -1 is what `accelerate config` writes for "all GPUs": fittrain's default, so not an option.
        "num_processes": lambda v: options.update(num_processes=_whole_number("num_processes", v, path, 1))
                                   if v not in (None, -1) else None,
        "num_machines": lambda v: options.update(nnodes=_whole_number("num_machines", v, path, 1)),
        "machine_rank": lambda v: options.update(node_rank=_whole_number("machine_rank", v, path, 0)),
        "main_process_ip": lambda v: options.update(main_process_ip=v),
        "main_process_port": lambda v: options.update(main_process_port=_port(v, path)),
        "gpu_ids": lambda v: options.update(gpu_ids=None if v in (None, "all") else str(v)),
        "rdzv_backend": lambda v: options.update(rdzv_backend=_rdzv_backend(v, path)),
        "dynamo_config": lambda v: options.update(dynamo_backend=_dynamo_backend(v or {}, path)),
        "fsdp_config": lambda v: _check_fsdp(v or {}, path),
    }
    for key, value in config.items():
        if key in readers:
            readers[key](value)
        elif key in _FIXED:
            _check_fixed(key, value, path)
        else:
            raise ValueError(f"`--config_file {path}` sets {key}={value!r}, an option fittrain does not know. Remove "
                             f"it, or tell us what it should do. Known keys: {', '.join(sorted([*readers, *_FIXED]))}.")
    return options


def merge(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Fills every option not given on the command line from `options` (the flag wins)."""
    for name in OVERRIDABLE:
        if getattr(args, name, None) in (None, False) and name in options:
            setattr(args, name, options[name])


def worker_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment variables that carry the parsed options to every worker."""
    env = {}
    if args.strategy is not None:
        env[STRATEGY_ENV] = args.strategy
    if args.mixed_precision is not None:
        env[MIXED_PRECISION_ENV] = args.mixed_precision
    if args.gradient_accumulation_steps is not None:
        env[ACCUMULATION_ENV] = str(args.gradient_accumulation_steps)
    if args.dynamo_backend is not None:
        env[DYNAMO_BACKEND_ENV] = args.dynamo_backend
    if args.cpu:
        env[USE_CPU_ENV] = "true"
    if args.debug:
        env[DEBUG_ENV] = "true"
    if args.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.gpu_ids
    if args.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    return env


def _strategy(value: Any, path: str) -> str | None:
    name = str(value).upper().removeprefix("DISTRIBUTEDTYPE.")
    if name not in _STRATEGY_OF_TYPE:
        raise ValueError(f"`--config_file {path}` sets distributed_type={value!r}, which fittrain does not run: it "
                         "runs plain torch.distributed with DDP or FSDP2. Use distributed_type: MULTI_GPU, MULTI_CPU "
                         "(both DDP), FSDP or NO.")
    return _STRATEGY_OF_TYPE[name]


def _dynamo_backend(config: dict[str, Any], path: str) -> str | None:
    for key, value in config.items():
        if key != "dynamo_backend" and _DYNAMO_DEFAULTS.get(key, object()) != value:
            raise ValueError(f"`--config_file {path}` sets dynamo_config.{key}={value!r}; fittrain takes only the "
                             "backend from a launch config. Pass further torch.compile options in the script, e.g. "
                             "Trainer(compile={'mode': ...}), and remove the key.")
    backend = config.get("dynamo_backend")
    return None if backend is None or str(backend).upper() == "NO" else str(backend).lower()


def _check_fsdp(config: dict[str, Any], path: str) -> None:
    for key, value in config.items():
        if key in _FSDP_FREE:
            continue  # which modules to shard and when to prefetch: FSDP2's defaults decide; no effect on results
        expected = _FSDP_AS_FITTRAIN.get(key, object())
        if _same(value, expected):
            continue
        hint = (f"fittrain's FSDP2 behaves as {key}: {expected!r}" if key in _FSDP_AS_FITTRAIN
                else "fittrain does not know this FSDP option")
        raise ValueError(f"`--config_file {path}` sets fsdp_config.{key}={value!r}, which fittrain cannot honour: "
                         f"{hint}. Remove the key or set it to that value (Accelerator(fsdp_classes=...) chooses "
                         "the modules to shard).")


def _check_fixed(key: str, value: Any, path: str) -> None:
    allowed = _FIXED[key]
    choices = allowed if isinstance(allowed, tuple) else (allowed,)
    if not any(_same(value, choice) for choice in choices):
        raise ValueError(f"`--config_file {path}` sets {key}={value!r}, which fittrain cannot honour (it supports "
                         f"{' or '.join(repr(c) for c in choices)}). Remove the key or change its value.")


def _as_int(value: Any) -> int | None:
    """A whole number, also one a config holds as a string ("2"); None for anything else (bools too)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        return int(value)
    return None


def _whole_number(key: str, value: Any, path: str, least: int) -> int | None:
    number = _as_int(value)
    if value is not None and (number is None or number < least):
        raise ValueError(f"`--config_file {path}` sets {key}={short_repr(value)}, which must be a whole number of at "
                         f"least {least}. Write it in digits, e.g. `{key}: {least + 1}`.")
    return number


def _port(value: Any, path: str) -> int | None:
    number = _as_int(value)
    if value is not None and (number is None or not 1 <= number <= MAX_PORT):
        raise ValueError(f"`--config_file {path}` sets main_process_port={short_repr(value)}, which must be a TCP "
                         f"port from 1 to {MAX_PORT}. {PORT_HINT}")
    return number


def _boolean(key: str, value: Any, path: str) -> bool:
    """A yes/no key: true or false (YAML's booleans, or their spelling as strings); null means false."""
    if value is None:
        return False
    for answer in (True, False):
        if _same(value, answer):
            return answer
    raise ValueError(f"`--config_file {path}` sets {key}={short_repr(value)}, which must be true or false. "
                     f"Write `{key}: true` or `{key}: false`.")


def _rdzv_backend(value: Any, path: str) -> str | None:
    if value is not None and value not in RDZV_BACKENDS:
        raise ValueError(f"`--config_file {path}` sets rdzv_backend={short_repr(value)}, which fittrain launch does "
                         f"not run. Use {' or '.join(RDZV_BACKENDS)}, or remove the key (static).")
    return value


def _same(value: Any, expected: Any) -> bool:
    """Equality that also takes config strings for booleans and numbers ("true", "2")."""
    if isinstance(expected, bool) and isinstance(value, str):
        return value.strip().lower() == str(expected).lower()
    if isinstance(expected, int) and isinstance(value, str) and value.strip().isdigit():
        return int(value) == expected
    return value == expected
