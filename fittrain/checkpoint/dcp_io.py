"""torch.distributed.checkpoint's file storage, with its metadata as JSON and nothing unpickled.

DCP's own `FileSystemWriter` pickles the checkpoint's metadata (`.metadata`), its reader unpickles
it, and its default load planner reads non-tensor values with `torch.load(weights_only=False)`.
fittrain keeps DCP's planning, resharding and per-rank shard files (`__{rank}_{i}.distcp`, each
tensor stored with `torch.save` and read back with `weights_only=True`) and replaces the rest:

- `JsonWriter` writes the metadata as `metadata.json`: for each tensor its dtype, global size and
  the chunks ranks wrote, and where each chunk lies in which file.
- `JsonReader` parses that JSON, within limits, into DCP's metadata objects.
- Only tensors are given to DCP (`sharded.py` keeps every other value, such as an optimizer's
  param_groups, in a file of its own); `TensorsOnlyLoadPlanner` refuses any other entry.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import CheckpointError

# DCP's metadata, as fittrain writes it beside the shard files (`sharded.METADATA_PATH`).
METADATA_NAME = "metadata.json"
_FORMAT = "fittrain-dcp-metadata"
# The dtypes a shard may hold (names as `str(torch.float32)` minus "torch."): nothing else is read.
_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(f"A sharded checkpoint cannot hold tensors of dtype {dtype}. Supported: "
                              f"{', '.join(sorted(_DTYPES))}.")
    return name


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """DCP's metadata as plain JSON data (tensors only; anything else is refused).

    Raises:
        CheckpointError: for a non-tensor entry or a stream transform, which fittrain never writes.
    """
    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"A sharded checkpoint holds tensors only; {fqn!r} is a {type(entry).__name__}.")
        tensors[fqn] = {"dtype": _dtype_name(entry.properties.dtype), "size": list(entry.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks]}
    storage = []
    for index, info in metadata.storage_data.items():
        if info.transform_descriptors:
            raise CheckpointError(f"A sharded checkpoint file uses stream transforms {info.transform_descriptors!r}, "
                                  "which fittrain does not write.")
        storage.append({"fqn": index.fqn, "offset": list(index.offset or ()), "file": info.relative_path,
                        "start": info.offset, "length": info.length})
    return {"format": _FORMAT, "version": metadata.version, "tensors": tensors, "storage": storage}


def _ints(value: Any, what: str) -> list[int]:
    if not (isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)):
        raise ValueError(f"{what} is not a list of non-negative integers")
    return value


def _tensor_entry(fqn: str, entry: Any) -> TensorStorageMetadata:
    if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPES and isinstance(entry.get("chunks"), list)):
        raise ValueError(f"tensor {fqn!r} has no valid dtype, size and chunks")
    size = _ints(entry.get("size"), f"the size of {fqn!r}")
    chunks = []
    for chunk in entry["chunks"]:
        if not (isinstance(chunk, list) and len(chunk) == 2):
            raise ValueError(f"a chunk of {fqn!r} is not [offsets, sizes]")
        offsets, sizes = _ints(chunk[0], f"a chunk offset of {fqn!r}"), _ints(chunk[1], f"a chunk size of {fqn!r}")
        if not (len(offsets) == len(sizes) == len(size)
                and all(o + s <= n for o, s, n in zip(offsets, sizes, size))):
            raise ValueError(f"a chunk of {fqn!r} lies outside its size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    properties = TensorProperties(dtype=_DTYPES[entry["dtype"]])
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def metadata_from_json(data: Any) -> Metadata:
    """Parses what `metadata_to_json` wrote back into DCP's metadata.

    Raises:
        ValueError: naming what is malformed (the caller names the file).
    """
    if not (isinstance(data, dict) and data.get("format") == _FORMAT and isinstance(data.get("tensors"), dict)
            and isinstance(data.get("storage"), list)):
        raise ValueError(f"it is not a {_FORMAT} file")
    tensors = {fqn: _tensor_entry(fqn, entry) for fqn, entry in data["tensors"].items()}
    storage = {}
    for item in data["storage"]:
        if not (isinstance(item, dict) and item.get("fqn") in tensors and isinstance(item.get("file"), str)
                and "/" not in item["file"] and item["file"].endswith(".distcp")):
            raise ValueError(f"a storage entry is malformed: {str(item)[:120]}")
        start, length = _ints([item.get("start"), item.get("length")], "a storage entry's start and length")
        offset = _ints(item.get("offset"), "a storage entry's offset")
        storage[MetadataIndex(item["fqn"], offset)] = _StorageInfo(item["file"], start, length)
    version = data.get("version") if isinstance(data.get("version"), str) else None
    return Metadata(state_dict_metadata=tensors, storage_data=storage, version=version)


class JsonWriter(FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced), with the metadata written as JSON.

    Args:
        path: The folder the shard files go into (it exists, inside the checkpoint being written).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """On the coordinating rank: writes the metadata of every rank's chunks, durably."""
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        text = json.dumps(metadata_to_json(metadata), sort_keys=True)
        with open(os.path.join(self.path, METADATA_NAME), "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


class JsonReader(FileSystemReader):
    """DCP's file reader, given metadata parsed from fittrain's JSON (never unpickled).

    Args:
        path: The folder with the shard files.
        metadata: What `metadata_from_json` returned for its metadata.json.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The parsed metadata (a copy: DCP sets fields on it)."""
        metadata = dataclasses.replace(self._metadata)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing non-tensor entries (DCP would unpickle them)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"A sharded checkpoint holds tensors only; {read_item.dest_index.fqn!r} is not one.")
