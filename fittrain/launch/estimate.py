"""`fittrain estimate`: each process's memory for a model under a layout, before any run.

    fittrain estimate mypackage.models:build --dp_replicate_size 2 --dp_shard_size 4 --tp_size 2 --sample_shape 8,512 \\
        --sample_dtype int64

builds the model by calling `build()` on the meta device (nothing is allocated) and prints what
`fittrain.distributed.memory_estimate.estimate_memory` counts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

import torch
from torch import nn

from fittrain.distributed.layout import ParallelismConfig
from fittrain.distributed.memory_estimate import OPTIMIZERS, estimate_memory


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds the `estimate` subcommand to the `fittrain` command line."""
    parser = subparsers.add_parser(
        "estimate", help="each process's memory for a model under a layout, before any run",
        description="Build a model on the meta device (nothing is allocated) and print the bytes one process\n"
                    "holds for its parameters, gradients and optimizer state under a layout (and the\n"
                    "activations one forward pass saves, given a sample batch shape).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="module:function that returns the model, e.g. mypackage.models:build")
    parser.add_argument("--dp_replicate_size", type=int, default=1, help="replica groups (HSDP with sharding)")
    parser.add_argument("--dp_shard_size", type=int, default=1, help="processes sharding each parameter (FSDP2)")
    parser.add_argument("--tp_size", type=int, default=1, help="tensor-parallel processes (the model's tp_plan)")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS), help="default: adamw")
    parser.add_argument("--sample_shape", help="one process's batch shape, e.g. 8,512: also count activations")
    parser.add_argument("--sample_dtype", default="float32", help="the sample's dtype (int64 for token ids)")
    parser.set_defaults(handler=_run, parser=parser)


def build_model(target: str) -> nn.Module:
    """Calls `module:function` on the meta device.

    Raises:
        ValueError: for a target that is not `module:function`, or a function that returns no nn.Module.
        ImportError, AttributeError: for a module or function that is not there.
    """
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"the model must be given as module:function. Received: {target!r}. For example "
                         "mypackage.models:build, where build() returns the nn.Module.")
    function = getattr(importlib.import_module(module_name), function_name)
    with torch.device("meta"):
        model = function()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{target}() must return an nn.Module. Received: {type(model).__name__}.")
    return model


def _sample(shape: str | None, dtype_name: str) -> Any:
    if shape is None:
        return None
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--sample_dtype must name a torch dtype, such as float32 or int64. Received: {dtype_name!r}.")
    try:
        sizes = [int(part) for part in shape.split(",")]
    except ValueError:
        raise ValueError(f"--sample_shape must be sizes separated by commas, such as 8,512. Received: {shape!r}.") \
            from None
    return torch.zeros(sizes, dtype=dtype, device="meta")


def _run(args: argparse.Namespace) -> int:
    try:
        layout = ParallelismConfig(dp_replicate_size=args.dp_replicate_size, dp_shard_size=args.dp_shard_size,
                                   tp_size=args.tp_size)
        model = build_model(args.model)
        estimate = estimate_memory(model, layout, args.optimizer, _sample(args.sample_shape, args.sample_dtype))
    except (ImportError, AttributeError, ValueError) as err:
        print(f"fittrain estimate: {err}", file=sys.stderr)
        return 1
    print(f"{args.model} on {layout.total_size} process(es) (dp_replicate_size={layout.dp_replicate_size}, "
          f"dp_shard_size={layout.dp_shard_size}), {args.optimizer}; one process holds:")
    print(estimate.table())
    return 0
