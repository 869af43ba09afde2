"""torch.distributed.checkpoint's file storage, with its metadata as JSON and nothing unpickled.

DCP's own `FileSystemWriter` pickles the checkpoint's metadata (`.metadata`), its reader unpickles
it, and its default load planner reads non-tensor values with `torch.load(weights_only=False)`.
fittrain keeps DCP's planning, resharding and per-rank shard files (`__{rank}_{i}.distcp`) and
replaces the rest:

- `RawWriter` writes each rank's chunks as raw bytes, one after another in one file per rank
  (C order, this machine's byte order, recorded), checksummed as they are written; and the
  metadata as `metadata.json`: for each tensor its dtype, global size and the chunks ranks wrote,
  and where each chunk lies in which file.
- `RawReader` reads every chunk straight into the tensor it fills (a staging buffer only when a
  chunk is read in part or the target is not a dense CPU tensor): no per-chunk `torch.load`,
  nothing to unpickle at all. `metadata_from_json` parses the JSON, within limits, and checks it
  whole before anything is read: every tensor's chunks tile it exactly (no gap, no overlap), each
  chunk has its bytes in a file, and no size is beyond what a file could hold.
- Only tensors are given to DCP (`sharded.py` keeps every other value, such as an optimizer's
  param_groups, in a file of its own); `TensorsOnlyLoadPlanner` refuses any other entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fittrain.checkpoint.crc import crc32_beside
from fittrain.checkpoint.errors import CheckpointError
from fittrain.common.reprs import short_repr

# DCP's metadata, as fittrain writes it beside the shard files (`sharded.METADATA_PATH`).
METADATA_NAME = "metadata.json"
_FORMAT = "fittrain-dcp-metadata"
# How chunks are stored in the shard files: raw bytes in C order (the only way fittrain ever released).
RAW = "raw"
# The largest tensor, in bytes or elements along one dimension, that metadata.json may describe: what
# a file offset (and torch's sizes) can hold. A hostile size is refused before anything is allocated.
_MAX_BYTES = 2**63 - 1
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
    return {"format": _FORMAT, "version": metadata.version, "items": RAW, "byteorder": sys.byteorder,
            "tensors": tensors, "storage": storage}


def _name(fqn: str) -> str:
    """A tensor's name for a message (a hostile file may hold a name of any length)."""
    return short_repr(fqn, 200)


def _are_ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and 0 <= v <= _MAX_BYTES for v in value)


def _ints(value: Any, what: str) -> list[int]:
    if not _are_ints(value):
        raise ValueError(f"{what} is not a list of integers from 0 to 2**63 - 1: {short_repr(value, 80)}")
    return value


def _tensor_entry(fqn: str, entry: Any) -> TensorStorageMetadata:
    if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPES and isinstance(entry.get("chunks"), list)):
        raise ValueError(f"tensor {_name(fqn)} has no valid dtype, size and chunks")
    size = _ints(entry.get("size"), f"the size of {_name(fqn)}")
    dtype = _DTYPES[entry["dtype"]]
    if math.prod(size) * dtype.itemsize > _MAX_BYTES:
        raise ValueError(f"tensor {_name(fqn)} of size {short_repr(size, 80)} would take more than 2**63 bytes")
    chunks = []
    for chunk in entry["chunks"]:  # messages are formatted only on failure: there may be 10**5 chunks
        if not (isinstance(chunk, list) and len(chunk) == 2 and _are_ints(chunk[0]) and _are_ints(chunk[1])):
            raise ValueError(f"a chunk of {_name(fqn)} is not [offsets, sizes], lists of integers from 0 to "
                             f"2**63 - 1: {short_repr(chunk, 80)}")
        offsets, sizes = chunk
        if not (len(offsets) == len(sizes) == len(size)
                and all(o + s <= n for o, s, n in zip(offsets, sizes, size))):
            raise ValueError(f"a chunk of {_name(fqn)} lies outside its size {short_repr(size, 80)} "
                             f"({len(size)} dimensions)")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    problem = _untiled(size, chunks)
    if problem:
        raise ValueError(f"the chunks of {_name(fqn)} do not tile it: {problem}")
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=chunks)


def _untiled(size: list[int], chunks: list[ChunkStorageMetadata]) -> str | None:
    """Where `chunks` (each within `size`) fail to cover a tensor of `size` exactly once; None if they do.

    DCP saves a sharded tensor as a grid: the chunks that share a range of dimension 0 split the
    rest alike, and so on. So the chunks are grouped by their range along one dimension, the
    ranges must follow one another from 0 to the end, and each group is checked along the next
    dimension: O(n log n) in the number of chunks, with no recursion however many dimensions.
    Empty chunks (a rank that holds no rows) cover nothing and are passed over.
    """
    if math.prod(size) == 0:
        return None
    pending = [([c for c in chunks if math.prod(c.sizes)], 0)]
    while pending:
        group, dim = pending.pop()
        if len(group) == 1 and tuple(group[0].sizes[dim:]) == tuple(size[dim:]):
            continue  # one chunk holding the rest whole (FSDP2's rows): the common case, at once
        if dim == len(size):  # one element of every dimension so far: one chunk must hold the block
            if len(group) != 1:
                where = short_repr(list(group[0].offsets), 80) if group else "[]"  # none: a scalar's
                return f"the block at {where} lies in {'more than one chunk' if group else 'no chunk'}"
            continue
        bands: dict[tuple[int, int], list[ChunkStorageMetadata]] = {}
        for chunk in group:
            bands.setdefault((chunk.offsets[dim], chunk.sizes[dim]), []).append(chunk)
        end = 0
        for start, length in sorted(bands):
            if start > end:
                return f"along dimension {dim}, indices {end} to {start} lie in no chunk"
            if start < end:
                overlap = f"{start} to {min(end, start + length)}"
                return f"along dimension {dim}, indices {overlap} lie in more than one chunk"
            end = start + length
            pending.append((bands[(start, length)], dim + 1))
        if end != size[dim]:
            return f"along dimension {dim}, indices {end} to {size[dim]} lie in no chunk"
    return None


def _chunk_bytes(tensors: dict[str, TensorStorageMetadata]) -> dict[tuple[str, tuple[int, ...]], int]:
    """The size in bytes of every chunk, keyed by tensor name and chunk offsets."""
    return {(fqn, tuple(chunk.offsets)): math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            for fqn, entry in tensors.items() for chunk in entry.chunks}


def _check_format(data: Any) -> None:
    """Refuses a file that is not fittrain's metadata of raw chunks in this machine's byte order."""
    if not (isinstance(data, dict) and data.get("format") == _FORMAT and isinstance(data.get("tensors"), dict)
            and isinstance(data.get("storage"), list)):
        raise ValueError(f"it is not a {_FORMAT} file")
    if "items" not in data:
        raise ValueError('it has no "items" (how its chunks are stored): it was written by a pre-release fittrain, '
                         "whose shard files are not read, or it was cut short")
    if data["items"] != RAW:
        raise ValueError(f"its chunks are stored as {short_repr(data['items'], 40)}, which fittrain does not know "
                         f"(it writes {RAW!r})")
    if data.get("byteorder") != sys.byteorder:
        raise CheckpointError(
            f"This sharded checkpoint's tensors are stored in {str(data.get('byteorder'))[:20]!r}-endian byte order, "
            f"and this machine is {sys.byteorder}-endian. Consolidate it (`fittrain consolidate`) on a machine "
            "of its byte order, then load the safetensors weights.")


def _storage_entries(data: list[Any], tensors: dict[str, TensorStorageMetadata]) -> dict[MetadataIndex, _StorageInfo]:
    """Where each chunk's bytes lie, checked: one entry of the chunk's length for every chunk."""
    sizes = _chunk_bytes(tensors)
    storage, stored = {}, set()
    for item in data:
        if not (isinstance(item, dict) and item.get("fqn") in tensors and isinstance(item.get("file"), str)
                and "/" not in item["file"] and item["file"].endswith(".distcp")):
            raise ValueError(f"a storage entry is malformed: {str(item)[:120]}")
        start, length = _ints([item.get("start"), item.get("length")], "a storage entry's start and length")
        offset = _ints(item.get("offset"), "a storage entry's offset")
        if sizes.get((item["fqn"], tuple(offset))) != length:
            raise ValueError(f"the storage entry of {_name(item['fqn'])} at {short_repr(offset, 80)} is {length} bytes "
                             "long, which is not the size of any of its chunks")
        storage[MetadataIndex(item["fqn"], offset)] = _StorageInfo(item["file"], start, length)
        stored.add((item["fqn"], tuple(offset)))
    for fqn, offsets in sizes:
        if (fqn, offsets) not in stored:
            raise ValueError(f"the chunk of {_name(fqn)} at {short_repr(list(offsets), 80)} has no storage entry: no "
                             "shard file holds its bytes")
    _check_disjoint(storage)
    return storage


def _check_disjoint(storage: dict[MetadataIndex, _StorageInfo]) -> None:
    """Refuses chunks whose bytes share a place in a file (`RawWriter` writes them one after
    another): chunks read from the same bytes many times would make a tensor larger than every file
    together, and allocating it would fail inside torch."""
    ranges = sorted((info.relative_path, info.offset, info.offset + info.length, index.fqn)
                    for index, info in storage.items() if info.length)
    for (file, _, end, fqn), (next_file, start, _, other) in zip(ranges, ranges[1:]):
        if file == next_file and start < end:
            raise ValueError(f"the bytes of {_name(fqn)} and {_name(other)} overlap in {short_repr(file, 60)} "
                             f"(at byte {start})")


def metadata_from_json(data: Any) -> Metadata:
    """Parses what `metadata_to_json` wrote back into DCP's metadata, checked whole.

    Raises:
        ValueError: naming what is malformed (the caller names the file): not this format, chunks
            that do not tile their tensor, a chunk without its bytes, a size beyond 2**63 bytes.
        CheckpointError: the chunks are raw bytes in the other byte order.
    """
    _check_format(data)
    tensors = {fqn: _tensor_entry(fqn, entry) for fqn, entry in data["tensors"].items()}
    storage = _storage_entries(data["storage"], tensors)
    version = data.get("version") if isinstance(data.get("version"), str) else None
    return Metadata(state_dict_metadata=tensors, storage_data=storage, version=version)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def _names_the_file(path: str) -> Iterator[None]:
    """A failed write (a full disk) raises an OSError without a file name; this adds `path`, so the
    error says which file of which checkpoint could not be written, as full checkpoints' errors do."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror, path) from err
        raise


class RawWriter(FileSystemWriter):
    """Writes this rank's chunks as raw bytes into one file, `__{rank}_0.distcp`, fsynced; and the
    metadata as JSON (on the coordinating rank).

    DCP plans the save (which rank writes which chunk; a replicated tensor once); this class only
    stores the bytes. The size and CRC32 of the file are computed as it is written, in `written`.

    Args:
        path: The folder the shard files go into (it exists, inside the checkpoint being written).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self.written: dict[str, tuple[int, int]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Writes every chunk of this rank's plan, in plan order."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, crc, offset = [], 0, 0
        path = os.path.join(self.path, name)
        with _names_the_file(path), open(path, "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(f"A sharded checkpoint holds tensors only; {item.index.fqn!r} is not one.")
                tensor = planner.resolve_data(item).detach().to("cpu").contiguous()
                if tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes):
                    raise CheckpointError(f"The chunk of {item.index.fqn!r} to save has shape {tuple(tensor.shape)}, "
                                          f"but DCP planned {tuple(item.tensor_data.chunk.sizes)}.")
                data = _as_bytes(tensor)
                crc = crc32_beside(data, crc, f.write)
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                           storage_data=_StorageInfo(name, offset, data.nbytes)))
                offset += data.nbytes
            f.flush()
            os.fsync(f.fileno())
        self.written[name] = (offset, crc)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        """On the coordinating rank: writes the metadata of every rank's chunks, durably."""
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        text = json.dumps(metadata_to_json(metadata), sort_keys=True)
        path = os.path.join(self.path, METADATA_NAME)
        with _names_the_file(path), open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _span(sizes: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """Where a block of a C-order chunk lies, as (first element, count), if it is one contiguous run.

    It is when every dimension before the first one longer than 1 is a single index and every one
    after it is whole (e.g. a range of rows: FSDP2 shards dimension 0).
    """
    first = next((d for d, n in enumerate(lengths) if n != 1), len(lengths))
    if any(lengths[d] != sizes[d] for d in range(first + 1, len(sizes))):
        return None
    start, stride = 0, 1
    for size, offset in zip(reversed(sizes), reversed(offsets)):
        start += offset * stride
        stride *= size
    return start, math.prod(lengths)


def _read_exact(f: BinaryIO, start: int, into: memoryview, path: str) -> None:
    f.seek(start)
    done = 0
    while done < into.nbytes:
        count = f.readinto(into[done:])
        if not count:
            raise CheckpointError(f"Checkpoint file {path!r} is damaged: it ends at byte {start + done}, before the "
                                  f"chunk that should end at byte {start + into.nbytes}. Load an earlier checkpoint.")
        done += count


class RawReader(FileSystemReader):
    """Reads raw chunks (`RawWriter`'s files) straight into the tensors they fill, given metadata
    parsed from fittrain's JSON (never unpickled).

    A chunk, or the run of rows of it that this rank needs, is read into its target in one call
    when the target is a dense CPU tensor of the saved dtype; otherwise through a staging tensor.

    Args:
        path: The shards folder.
        metadata: What `metadata_from_json` returned for its metadata.json.
        held: Shard files already open, by name (`CheckpointReader.hold`): read from, not closed.
            Others are opened by path.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata,
                 held: dict[str, BinaryIO] | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._held = held or {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The parsed metadata (a copy: DCP sets fields on it)."""
        metadata = dataclasses.replace(self._metadata)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads every item of this rank's plan, file by file, in file order."""
        chunks = {(fqn, tuple(chunk.offsets)): (tuple(chunk.sizes), entry.properties.dtype)
                  for fqn, entry in self._metadata.state_dict_metadata.items() for chunk in entry.chunks}
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            path = os.path.join(self.path, name)
            held = self._held.get(name)
            with contextlib.nullcontext(held) if held is not None else open(path, "rb", buffering=0) as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    sizes, dtype = chunks[(item.storage_index.fqn, tuple(item.storage_index.offset))]
                    self._read_item(f, path, item, planner, sizes, dtype)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, f: BinaryIO, path: str, item: Any, planner: LoadPlanner, sizes: tuple[int, ...],
                   dtype: torch.dtype) -> None:
        start = self.storage_data[item.storage_index].offset
        target = planner.resolve_tensor(item).detach()
        lengths = tuple(item.lengths)
        span = _span(sizes, tuple(item.storage_offsets), lengths)
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        if span is not None:
            into = target if direct else torch.empty(lengths, dtype=dtype)
            _read_exact(f, start + span[0] * dtype.itemsize, _as_bytes(into), path)
        else:  # a block that is not one run: read the whole chunk, then copy the block out
            chunk = torch.empty(sizes, dtype=dtype)
            _read_exact(f, start, _as_bytes(chunk), path)
            into = chunk
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, lengths)):
                into = into.narrow(dim, offset, length)
        if into is not target:
            target.copy_(into)
        planner.commit_tensor(item, target)


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing non-tensor entries (DCP would unpickle them)."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"A sharded checkpoint holds tensors only; {read_item.dest_index.fqn!r} is not one.")
