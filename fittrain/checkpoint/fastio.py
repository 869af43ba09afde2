"""The checkpoint file writer: files streamed to disk once, checksummed as they are written.

`CheckpointWriter` (made by `folder.atomic_checkpoint`, which owns the folder and the manifest;
`reader` reads the files back) sends every file through a `ChecksumSink`, which keeps the
running size and CRC32 (a large write's on a thread beside the write: `crc`), so a file is never
held whole in memory nor read back: `torch.save` streams straight into it, and
`write_safetensors` writes the header and then each tensor's bytes as a zero-copy view. Its
files are byte-identical to ``safetensors.torch.save`` of the same tensors and metadata (same
dtype-then-name order, compact JSON header padded with spaces to 8 bytes). `BackgroundSync`
fsyncs finished files on threads while the next file is written; the writer's owner joins it
before the folder is renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import safetensors.torch
import torch

from fittrain.checkpoint.crc import crc32_beside
from fittrain.checkpoint.temp_folders import WRITER_MARKER

MANIFEST_NAME = "manifest.json"
_CHUNK = 16 * 1024 * 1024

# The safetensors dtype names, in the order of the Rust crate's `Dtype` enum. It writes tensors
# sorted by that order descending (wider dtypes first, so every tensor stays aligned), then by
# name; following it makes our files byte-identical to its own.
_DTYPE_ORDER = [
    ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"), ("I16", "int16"), ("U16", "uint16"), ("F16", "float16"),
    ("BF16", "bfloat16"), ("I32", "int32"), ("U32", "uint32"), ("F32", "float32"),
    ("C64", "complex64"), ("F64", "float64"), ("I64", "int64"), ("U64", "uint64"),
]
_DTYPES = {getattr(torch, attr): (name, rank) for rank, (name, attr) in enumerate(_DTYPE_ORDER)
           if hasattr(torch, attr)}


def _is_plain_name(name: Any) -> bool:
    """Whether a file name stays inside its folder and does not clash with the manifest."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST_NAME, WRITER_MARKER)
            and "/" not in name and "\\" not in name)


#: How deep a file that a save hook wrote may sit below the checkpoint folder.
MAX_SUBFOLDER_DEPTH = 8


def is_listed_name(name: Any) -> bool:
    """Whether a manifest entry is a safe relative path inside the checkpoint folder: a plain name,
    or (files a save_state pre-hook wrote) plain names joined by "/", a few levels deep."""
    if not isinstance(name, str) or "\\" in name:
        return False
    parts = name.split("/")
    return (len(parts) <= MAX_SUBFOLDER_DEPTH + 1 and _is_plain_name(parts[0])
            and all(part not in ("", ".", "..") for part in parts))


class ChecksumSink:
    """A write-only file wrapper that keeps the running size and CRC32 of what went through it.

    The first OSError of a write is kept in `error`: `torch.save` turns it into a RuntimeError
    ("unexpected pos") that no longer says the disk is full.

    Args:
        file: An open binary file; unbuffered, so each large write goes straight to the OS.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.size = 0
        self.crc32 = 0
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Writes all of `data`, updating the size and checksum, and returns its length."""
        view = memoryview(data).cast("B")
        self.crc32 = crc32_beside(view, self.crc32, self._write_all)
        self.size += view.nbytes
        return view.nbytes

    def _write_all(self, view: memoryview) -> None:
        written = 0
        try:
            while written < view.nbytes:  # A raw write may be partial.
                written += self._file.write(view[written:])
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        """Flushes the wrapped file (called by `torch.save`)."""
        self._file.flush()


def saveable_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Returns detached, contiguous CPU tensors in which no two keys share memory.

    safetensors refuses tensors that share storage (tied weights). Every key is kept and each
    later alias becomes its own copy, so the file loads strictly with safetensors alone.

    Raises:
        TypeError: A key is not a string or a value is not a tensor.
    """
    result: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in tensors.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                "Tensors to save must be a dict of str keys to torch.Tensor values. "
                f"Received: key {key!r} with a value of type {type(value).__name__}. "
                "Remove non-tensor entries before saving."
            )
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr():
            if storage.data_ptr() in seen:
                tensor = tensor.clone()
            else:
                seen.add(storage.data_ptr())
        result[key] = tensor
    return result


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length plus the JSON header, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for key, tensor in tensors:
        end = offset + tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype][0], "shape": list(tensor.shape),
                       "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    sink: ChecksumSink, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> None:
    """Writes tensors in the safetensors format without building the file in memory.

    A dtype this module does not know, or a big-endian machine, falls back to
    ``safetensors.torch.save``.

    Args:
        sink: Where the file's bytes go.
        tensors: The tensors, by key, as `saveable_tensors` returns them.
        metadata: Optional string metadata for the header's ``__metadata__``.
    """
    saveable = dict(tensors)
    if sys.byteorder != "little" or any(t.dtype not in _DTYPES for t in saveable.values()):
        sink.write(safetensors.torch.save(saveable, dict(metadata) if metadata else None))
        return
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError(
            f"safetensors metadata must map str to str. Received: {dict(metadata)!r:.200}."
        )
    ordered = sorted(saveable.items(), key=lambda item: (-_DTYPES[item[1].dtype][1], item[0]))
    sink.write(_header(ordered, metadata))
    for _, tensor in ordered:
        if tensor.numel():
            sink.write(tensor.reshape(-1).view(torch.uint8).numpy())


class BackgroundSync:
    """Fsyncs and closes finished files on threads, so the next file is written meanwhile.

    `join` waits for all of them and raises the first error, so a failed fsync still fails the
    save before the folder is renamed into place.
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def add(self, file: BinaryIO) -> None:
        """Takes over an open file: it is fsynced and closed on a thread."""
        # Not a daemon: a process that exits right after a save still finishes its fsyncs.
        thread = threading.Thread(target=self._sync, args=(file,))
        thread.start()
        self._threads.append(thread)

    def _sync(self, file: BinaryIO) -> None:
        try:
            os.fsync(file.fileno())
        except BaseException as err:  # Re-raised by join() in the writing thread.
            self._errors.append(err)
        finally:
            file.close()

    def join(self) -> None:
        """Waits for every pending fsync and raises the first error, if any."""
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


class CheckpointWriter:
    """Collects files for one checkpoint folder being written in a temporary sibling folder.

    `atomic_checkpoint` creates the writer; each process writes only its own files. Each file is
    streamed to disk once while its size and CRC32 are computed for the manifest, then fsynced
    on a background thread; `atomic_checkpoint` waits for every fsync before the folder is
    renamed, so a renamed folder is durable. A writer used directly finishes its fsyncs before
    the process exits.

    Args:
        directory: The temporary folder being written. It must exist already.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = pathlib.Path(directory)
        self._records: dict[str, dict[str, int]] = {}
        self._syncs = BackgroundSync()

    @property
    def path(self) -> pathlib.Path:
        """The temporary folder being written."""
        return self._path

    def _write_file(self, name: str, fill: Callable[[ChecksumSink], None]) -> None:
        """Creates `name`, lets `fill` stream its contents, records it and queues its fsync.

        Every write_* method ends here. A `fill` that fails removes the partial file.

        Raises:
            ValueError: `name` leaves the folder or is the manifest's name. (A name in a subfolder,
                "shards/values.pt", needs the subfolder to exist.)
        """
        if not is_listed_name(name) or ("/" in name and not (self._path / name).parent.is_dir()):
            raise ValueError(
                "A checkpoint file name must be a plain file name (or a path into a subfolder that was made "
                f"first), other than {MANIFEST_NAME!r}. Received: name={name!r}. Pass a name such as 'optimizer.pt'."
            )
        path = self._path / name
        file = open(path, "wb", buffering=0)
        sink = ChecksumSink(file)
        try:
            fill(sink)
        except BaseException as err:
            file.close()
            with contextlib.suppress(OSError):
                path.unlink()
            if sink.error is not None:  # the disk's own error, not what a serializer made of it
                raise OSError(sink.error.errno, sink.error.strerror, os.fspath(path)) from err
            raise
        self._syncs.add(file)
        self._records[name] = {"size": sink.size, "crc32": sink.crc32}

    def record(self, name: str, size: int, crc32: int) -> None:
        """Lists a file that is already in the folder (another process wrote it and checksummed it),
        so the manifest takes its size and CRC32 without reading it again."""
        self._records[name] = {"size": size, "crc32": crc32}

    def _wait_durable(self) -> None:
        """Waits until every file written so far is fsynced; raises a failed fsync's error."""
        self._syncs.join()

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Writes raw bytes as one file and records its size and checksum.

        Args:
            name: A plain file name inside the checkpoint folder.
            data: The file's full contents.

        Raises:
            ValueError: `name` has folders in it or is the manifest's name.
        """
        self._write_file(name, lambda sink: sink.write(data))

    def write_tensors(
        self, name: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Writes tensors as a safetensors file, streaming each tensor's bytes without a copy.

        Tensors are moved to the CPU and made contiguous; tied tensors are written as copies.
        The file is byte-identical to ``safetensors.torch.save`` of the same tensors.

        Args:
            name: A plain file name, such as 'model.safetensors'.
            tensors: The tensors, by key.
            metadata: Optional string metadata stored in the safetensors header.

        Raises:
            TypeError: A value is not a tensor.
        """
        saveable = saveable_tensors(tensors)
        self._write_file(name, lambda sink: write_safetensors(sink, saveable, metadata))

    def write_torch(self, name: str, obj: Any) -> None:
        """Writes an object with `torch.save`, streamed straight into the file.

        The object must load with ``torch.load(weights_only=True)``: tensors, dicts, lists,
        tuples, numbers, strings and None. Anything else is refused when it is read back.

        Args:
            name: A plain file name, such as 'optimizer.pt'.
            obj: The object to save.
        """
        self._write_file(name, lambda sink: torch.save(obj, sink))

    def write_json(self, name: str, obj: Any) -> None:
        """Writes a JSON-serializable object as indented, key-sorted JSON.

        Args:
            name: A plain file name, such as 'trainer_state.json'.
            obj: The object to save.
        """
        data = json.dumps(obj, indent=2, sort_keys=True).encode("utf-8")
        self._write_file(name, lambda sink: sink.write(data))
