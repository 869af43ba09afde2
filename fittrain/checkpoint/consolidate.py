"""`fittrain consolidate CHECKPOINT OUT`: a checkpoint's model weights as whole safetensors files.

A sharded checkpoint (`Accelerator(state_dict_type="sharded")`, the default under FSDP2) holds
each rank's shards; this turns one model's into `model.safetensors` (or numbered shards plus
`model.safetensors.index.json` past `--max_shard_size`), loadable with safetensors alone, on one
machine with no process group. One output file's worth of tensors is in memory at a time: each is
assembled from the chunks every rank wrote (DCP reads only the ones needed). Every file is checked
against the checkpoint's manifest first. A full checkpoint's `model.safetensors` is copied.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import torch

from fittrain.checkpoint.errors import CheckpointError
from fittrain.checkpoint.model_io import parse_size, save_model_weights
from fittrain.checkpoint.reader import CheckpointReader
from fittrain.checkpoint.sharded import read_index, read_tensors, saved_indices, shard_files
from fittrain.checkpoint.snapshot import indexed_name
from fittrain.common.checks import check_non_negative_int


def _placeholder(entry: Any) -> torch.Tensor:
    """A tensor with the saved size and dtype that holds no memory (for planning the output files)."""
    return torch.empty((), dtype=entry.properties.dtype).expand(*entry.size)


def _check_arguments(checkpoint: str | pathlib.Path, out: str | pathlib.Path, model: Any,
                     max_shard_size: int | str) -> None:
    """Refuses bad arguments before the checkpoint is read (which may take minutes)."""
    check_non_negative_int("model", model, wanted="an int of 0 or more: which prepared model, in prepare() order",
                           fix="Pass e.g. model=0.")
    parse_size(max_shard_size)
    path = pathlib.Path(out)
    source = pathlib.Path(checkpoint).resolve()
    if path.resolve() == source or source in path.resolve().parents:
        # Files added to a checkpoint folder are not in its manifest: the folder would stop verifying.
        raise ValueError(f"`out` must lie outside the checkpoint folder it reads. Received: out={str(path)!r}, "
                         f"checkpoint={str(checkpoint)!r}. Pass another folder, e.g. out='weights'.")
    for folder in (path, *path.parents):  # the nearest one that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                where = "which is a file" if folder == path else f"inside {str(folder)!r}, which is a file"
                raise FileExistsError(f"`out` must be a folder to write the weights into (created if missing). "
                                      f"Received: out={str(path)!r}, {where}. Pass the path of a folder.")
            return


def consolidate(checkpoint: str | pathlib.Path, out: str | pathlib.Path, model: int = 0,
                max_shard_size: int | str = "10GB") -> list[pathlib.Path]:
    """Writes model `model`'s weights from a checkpoint folder as safetensors files in `out`.

    Returns:
        The files written.

    Raises:
        TypeError, ValueError: `model` is not an index, `max_shard_size` not a size, or `out` lies
            inside the checkpoint.
        FileExistsError: `out` is a file, or lies inside one.
        FileNotFoundError: the checkpoint folder does not exist.
        CheckpointError: a file is missing or damaged, or the checkpoint has no model `model`.
    """
    _check_arguments(checkpoint, out, model, max_shard_size)
    reader = CheckpointReader(checkpoint)
    full_name = indexed_name("model", model, "safetensors")
    if reader.has(full_name):  # a full checkpoint: its weights are whole already
        return save_model_weights(reader.read_tensors(full_name), out, max_shard_size)
    if not reader.has("shards/metadata.json"):
        raise CheckpointError(f"Checkpoint {reader.path} has neither {full_name} nor sharded weights "
                              "(shards/metadata.json). Pass a folder that save_state wrote.")
    metadata, values = read_index(reader)
    models = saved_indices(values, "model")
    if model not in models:
        raise CheckpointError(f"Checkpoint {reader.path} has no model {model}; it holds models {models}. "
                              "Pass --model with one of them.")
    reader.verify(shard_files(reader))
    prefix = f"model_{model}/"
    planned = {key[len(prefix):]: _placeholder(entry)
               for key, entry in metadata.state_dict_metadata.items() if key.startswith(prefix)}

    def materialize(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = {prefix + key: torch.empty(p.shape, dtype=p.dtype) for key, p in shard.items()}
        read_tensors(reader, tensors, metadata)
        return {key[len(prefix):]: tensor for key, tensor in tensors.items()}

    return save_model_weights(planned, out, max_shard_size, materialize=materialize)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds the `consolidate` subcommand to the `fittrain` command line."""
    parser = subparsers.add_parser(
        "consolidate", help="write a checkpoint's model weights as whole safetensors files",
        description="Turn the model weights of a checkpoint folder (sharded, as FSDP2 saves by default, or\n"
                    "full) into model.safetensors, or numbered shards plus an index, loadable with\n"
                    "safetensors alone. Runs on one machine, without processes to match the run.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder that save_state wrote")
    parser.add_argument("out", help="the folder to write the weights into (created if missing)")
    parser.add_argument("--model", type=int, default=0, help="which prepared model, in prepare() order (default: 0)")
    parser.add_argument("--max_shard_size", default="10GB", help="largest output file, e.g. 5GB (default: 10GB)")
    parser.set_defaults(handler=_run, parser=parser)


def _run(args: argparse.Namespace) -> int:
    try:
        written = consolidate(args.checkpoint, args.out, args.model, args.max_shard_size)
    except (OSError, CheckpointError, ValueError) as err:
        print(f"fittrain consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} file(s) to {args.out}: {', '.join(p.name for p in written)}")
    return 0
