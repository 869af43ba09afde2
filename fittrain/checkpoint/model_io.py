"""Model weights files in the Hugging Face layout: one file, or numbered shards plus an index.

``save_model_weights`` writes ``model.safetensors`` (or ``pytorch_model.bin``), or shards named
``model-00001-of-00003.safetensors`` with ``model.safetensors.index.json``, the layout that
Accelerate's ``save_model`` and Transformers' ``from_pretrained`` use. Each file is replaced
atomically, and files left by an earlier save in the same layout are removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import json
import os
import pathlib
import re
import types
from collections.abc import Callable, Mapping

import safetensors.torch
import torch

from fittrain.checkpoint.errors import CheckpointError
from fittrain.checkpoint.errors import brief as _brief
from fittrain.checkpoint.fastio import saveable_tensors as _saveable_tensors
from fittrain.checkpoint.reader import CheckpointReader
from fittrain.checkpoint.renames import fsync_dir as _fsync_dir
from fittrain.checkpoint.sharded import read_index, whole_model
from fittrain.common.checks import is_int

_SIZE_PATTERN = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_UNITS = types.MappingProxyType({
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
})


@dataclasses.dataclass(frozen=True)
class _Family:
    """The file names of one weights format: a single file, its shards and their index."""

    stem: str
    extension: str
    safe: bool

    @property
    def single(self) -> str:
        return f"{self.stem}.{self.extension}"

    @property
    def index(self) -> str:
        return f"{self.single}.index.json"

    def shard(self, number: int, count: int) -> str:
        return f"{self.stem}-{number:05d}-of-{count:05d}.{self.extension}"

    def owns(self, name: str) -> bool:
        """Whether `name` is one of this family's files, from this save or an earlier one."""
        pattern = rf"{re.escape(self.stem)}(-[0-9]{{5,}}-of-[0-9]{{5,}})?\.{self.extension}"
        return name == self.index or re.fullmatch(pattern, name) is not None


_SAFETENSORS = _Family("model", "safetensors", safe=True)
_PICKLE = _Family("pytorch_model", "bin", safe=False)


def parse_size(size: int | str, *, argument: str = "max_shard_size") -> int:
    """Converts a size such as 5000, "5MB" or "1.5GiB" to a number of bytes.

    Units are case-insensitive. KB, MB, GB and TB are powers of 1000 and KiB, MiB, GiB and TiB
    powers of 1024, as in Accelerate. A string without a unit is a number of bytes.

    Args:
        size: A positive int of bytes, or a number followed by a unit.
        argument: The argument name to show in the error message.

    Returns:
        The size in bytes, at least 1.

    Raises:
        ValueError: `size` is not a positive int or a string in this form.
    """
    count = 0
    if is_int(size):
        count = size
    elif isinstance(size, str) and (match := _SIZE_PATTERN.fullmatch(size)):
        unit = _UNITS[(match.group(2) or "b").lower()]
        count = int(decimal.Decimal(match.group(1)) * unit)
    if count < 1:
        raise ValueError(
            f"`{argument}` must be a positive int of bytes or a string such as '5MB' or "
            f"'1.5GiB'. Received: {argument}={size!r}."
        )
    return count


def _check_state_dict(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Refuses entries that cannot be written as weights before any file is touched."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "`state_dict` must be a dict of str keys to tensors, such as model.state_dict(). "
            f"Received: a {type(state_dict).__name__}."
        )
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                "`state_dict` must map str keys to tensors. Received: key "
                f"{key!r} with a value of type {type(value).__name__}. Remove that entry."
            )
        if value.is_meta:
            raise ValueError(
                f"Tensor {key!r} is on the meta device and holds no data. Received: {value!r}. "
                "Materialize the model's weights before saving it."
            )


def _split(state_dict: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Groups tensors greedily in key order into shards of at most `limit` bytes.

    A tensor larger than the limit gets a shard of its own. There is always one shard.
    """
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for key, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and filled + size > limit:
            shards.append({})
            filled = 0
        shards[-1][key] = tensor
        filled += size
    return shards


def _write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Writes a file under a temporary name, fsyncs it and renames it over `path`."""
    temp = path.with_name(f".{path.name}.tmp")
    try:
        write(temp)
        with open(temp, "rb+") as f:  # "+" because Windows refuses fsync on read-only handles.
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def _write_shard(path: pathlib.Path, shard: Mapping[str, torch.Tensor], family: _Family) -> None:
    # Converting one shard at a time keeps at most one shard's CPU copy alive.
    tensors = _saveable_tensors(shard)
    if family.safe:
        _write_atomically(
            path, lambda temp: safetensors.torch.save_file(tensors, temp, metadata={"format": "pt"})
        )
    else:
        _write_atomically(path, lambda temp: torch.save(tensors, temp))


def _remove_stale(directory: pathlib.Path, family: _Family, keep: set[str]) -> None:
    """Deletes this family's files that the save just finished did not write."""
    for entry in directory.iterdir():
        if family.owns(entry.name) and entry.name not in keep and entry.is_file():
            entry.unlink()
    _fsync_dir(directory)


def save_model_weights(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    *,
    materialize: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    is_main_process: bool = True,
) -> list[pathlib.Path]:
    """Writes a state_dict as one weights file, or as shards plus an index.

    Tensors go to the CPU and are made contiguous. Keys that share memory (tied weights) are all
    kept, each written as its own copy, so ``model.load_state_dict(load_file(path))`` works with
    safetensors alone. Shards are filled greedily in key order. The index is written after the
    shards, and files left by an earlier save in the same format are removed last.

    Args:
        state_dict: The weights, such as ``model.state_dict()``.
        save_directory: The folder to write; it is created if missing.
        max_shard_size: The largest shard, as an int of bytes or a string such as "5MB".
        safe_serialization: Write safetensors when True, ``torch.save`` ``.bin`` files when False.
        materialize: Turns one shard's tensors into whole tensors before it is written, such as
            FSDP2's DTensors gathered one at a time (a collective: every process calls this
            function with the same state dict). One shard is whole at a time, so memory stays
            within `max_shard_size`, not the model's size. Shards are planned by global sizes.
        is_main_process: Whether this process writes the files (the others only materialize).

    Returns:
        The paths written: the weights files, then the index if there is one (on the main process).

    Raises:
        ValueError: `max_shard_size` is not a valid size, or a tensor is on the meta device.
        TypeError: `state_dict` holds a value that is not a tensor.
    """
    limit = parse_size(max_shard_size)
    _check_state_dict(state_dict)
    family = _SAFETENSORS if safe_serialization else _PICKLE
    directory = pathlib.Path(save_directory)
    if is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
    shards = _split(state_dict, limit)
    names = [family.single] if len(shards) == 1 else [
        family.shard(number, len(shards)) for number in range(1, len(shards) + 1)
    ]
    for name, shard in zip(names, shards):
        whole = shard if materialize is None else materialize(shard)
        if is_main_process:
            _write_shard(directory / name, whole, family)
        del whole  # before the next shard is materialized
    if not is_main_process:
        return []
    written = [directory / name for name in names]
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
        }
        text = json.dumps(index, indent=2, sort_keys=True).encode("utf-8")
        _write_atomically(directory / family.index, lambda temp: temp.write_bytes(text))
        written.append(directory / family.index)
    _fsync_dir(directory)
    _remove_stale(directory, family, keep={path.name for path in written})
    return written


def _load_file(path: pathlib.Path, family: _Family) -> dict[str, torch.Tensor]:
    """Loads one weights file without unpickling anything but plain tensors."""
    try:
        if family.safe:
            return safetensors.torch.load_file(path, device="cpu")
        tensors = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(
            f"Cannot load weights file {str(path)!r}: it is damaged or is not a plain-tensor "
            f"file (nothing in it was executed). Detail: {_brief(err)}. Save the model again."
        ) from err
    if not (isinstance(tensors, dict)
            and all(isinstance(t, torch.Tensor) for t in tensors.values())):
        raise CheckpointError(
            f"Weights file {str(path)!r} does not hold a dict of tensors. Received: a "
            f"{type(tensors).__name__}. Save it with save_model_weights."
        )
    return tensors


def _load_sharded(index_path: pathlib.Path, family: _Family) -> dict[str, torch.Tensor]:
    """Loads every shard an index names and checks that each indexed key was found."""
    try:
        weight_map = json.loads(index_path.read_bytes())["weight_map"]
        shard_names = list(dict.fromkeys(weight_map.values()))
        if not all(isinstance(n, str) and family.owns(n) for n in shard_names):
            raise ValueError(f"shard names must look like {family.shard(1, 2)!r}")
    except RecursionError:  # the JSON decoder recurses once per level of nesting
        raise CheckpointError(
            f"Index file {str(index_path)!r} is damaged: it is nested too deeply to be an index. "
            "Save the model again."
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"Index file {str(index_path)!r} is damaged: {type(err).__name__}: {_brief(err)[:200]}. "
            "Save the model again."
        ) from err
    tensors: dict[str, torch.Tensor] = {}
    for name in shard_names:
        tensors.update(_load_file(index_path.parent / name, family))
    missing = [key for key in weight_map if key not in tensors]
    if missing:
        raise CheckpointError(
            f"Index file {str(index_path)!r} lists keys that no shard holds: {missing[:5]}. "
            "The save is incomplete or mixed with another one; save the model again."
        )
    return tensors


def load_model_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Loads the weights that `save_model_weights` wrote to a folder, onto the CPU.

    Looks for, in order, model.safetensors, model.safetensors.index.json, pytorch_model.bin and
    pytorch_model.bin.index.json. ``.bin`` files are read with ``torch.load(weights_only=True)``.
    A sharded checkpoint folder (its `shards/`) gives its first model's weights, assembled from
    every rank's shards after their checksums were verified.

    Args:
        directory: The folder holding the weights (or a checkpoint folder).

    Returns:
        The tensors, by key.

    Raises:
        FileNotFoundError: None of those files is in the folder.
        CheckpointError: A weights file or the index is damaged or unsafe.
    """
    folder = pathlib.Path(directory)
    # The shards/ folder, not its metadata.json, marks a sharded checkpoint: one whose metadata.json
    # was deleted must be refused by the reader (the manifest lists it), not searched for weights.
    if (folder / "shards").is_dir() and not (folder / _SAFETENSORS.single).exists():
        reader = CheckpointReader(folder)
        return whole_model(reader, read_index(reader))
    for family in (_SAFETENSORS, _PICKLE):
        if (folder / family.single).is_file():
            return _load_file(folder / family.single, family)
        if (folder / family.index).is_file():
            return _load_sharded(folder / family.index, family)
    looked_for = [name for f in (_SAFETENSORS, _PICKLE) for name in (f.single, f.index)]
    raise FileNotFoundError(
        f"No model weights in folder {str(folder)!r}: looked for {looked_for}. Pass the folder "
        "that save_model wrote."
    )
