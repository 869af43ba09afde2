"""Verified reads of a complete checkpoint folder: `CheckpointReader` and `is_intact`.

Reads use only safetensors, JSON or ``torch.load(weights_only=True)``. A read takes a file into
memory once and checks its size and CRC32 against the manifest (written last by `folder`) before
anything parses it; nothing loaded keeps a checkpoint's file open or mapped, so a pruned folder
frees its disk space at once. (A sharded load holds its shard files open while it runs, `hold`:
what was verified is then what is read, even if the folder is pruned meanwhile.) JSON is parsed
with limits on size and nesting, so a hostile file is a damaged one, never a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import stat
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Iterable

import safetensors.torch
import torch

from fittrain.checkpoint.crc import crc32, file_checksum
from fittrain.checkpoint.errors import CheckpointDeletedError, CheckpointError, brief
from fittrain.checkpoint.fastio import MANIFEST_NAME, is_listed_name
from fittrain.checkpoint.folder import MANIFEST_FORMAT, MANIFEST_VERSION
from fittrain.common.checks import is_int
from fittrain.common.nested import map_tensors
from fittrain.common.reprs import short_repr

# Limits for the JSON files of a checkpoint (the manifest, accelerator_state.json). Real ones are
# tiny and three levels deep; the caps keep a hostile file from exhausting memory or the stack.
_JSON_MAX_BYTES = 64 * 1024 * 1024
#: The most files `CheckpointReader.hold` keeps open at once (the process's descriptors are limited).
HOLD_MAX = 256
_JSON_MAX_DEPTH = 32


# Files are parsed through a memory map (the checksum pass just brought their pages into the page
# cache) and every tensor is then copied out of it by `_owned`: one copy, and no mapping outlives
# the read. Windows maps files differently, so it reads them plainly.
_MMAP = os.name != "nt"


def _owned(obj: Any) -> Any:
    """`obj` with every tensor in it (in dicts, lists and tuples) copied into memory of its own.

    A tensor kept by a live object (an optimizer's state) must not keep its checkpoint file
    mapped: the file's disk space would stay used after `total_limit` deleted the folder.
    """
    return map_tensors(torch.Tensor.clone, obj)


def _as_is(obj: Any) -> Any:
    return obj


def _is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _json_depth(value: Any) -> int:
    """The nesting depth of a decoded JSON value, found without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth <= _JSON_MAX_DEPTH and isinstance(item, (dict, list)):
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _parse_json(data: bytes, path: pathlib.Path) -> Any:
    """Decodes a checkpoint's JSON file, refusing anything too large or too deeply nested.

    Raises:
        CheckpointError: naming the file, for any failure (a hostile file raises nothing else).
    """
    if len(data) > _JSON_MAX_BYTES:
        raise _json_error(path, f"over {_JSON_MAX_BYTES} bytes")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError, MemoryError) as err:
        # RecursionError: the decoder recurses once per level of nesting.
        raise _json_error(path, "nested too deeply" if isinstance(err, RecursionError) else brief(err)) from None
    if _json_depth(value) > _JSON_MAX_DEPTH:
        raise _json_error(path, f"nested more than {_JSON_MAX_DEPTH} levels deep")
    return value


def _json_error(path: pathlib.Path, detail: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint file {str(path)!r} is not a valid checkpoint JSON file ({detail}). The checkpoint "
        "is damaged; load an earlier one."
    )


def _read_capped(path: pathlib.Path, limit: int) -> bytes:
    """Reads at most `limit + 1` bytes, so an oversized file is refused without reading it all."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


def _parse_manifest(path: pathlib.Path) -> dict[str, dict[str, int]]:
    """Reads and validates a manifest, returning its file records."""
    try:
        data = _read_capped(path, _JSON_MAX_BYTES)
    except OSError as err:
        raise CheckpointError(f"Cannot read {path}: {err}. Load an earlier checkpoint.") from err
    manifest = _parse_json(data, path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    valid = (
        isinstance(files, dict)
        and manifest.get("format") == MANIFEST_FORMAT and manifest.get("version") == MANIFEST_VERSION
        and all(is_listed_name(name) and isinstance(record, dict) and _is_count(record.get("size"))
                and _is_count(record.get("crc32")) for name, record in files.items())
    )
    if not valid:
        raise CheckpointError(
            f"{path} is not a valid version-{MANIFEST_VERSION} fittrain manifest. Received: "
            f"{short_repr(manifest, limit=300)}. The checkpoint is damaged or was written by another version; "
            "load an earlier checkpoint or use the fittrain that wrote it."
        )
    return files


class CheckpointReader:
    """Reads files of a complete checkpoint folder, checking each against the manifest.

    Every read checks the file's size and CRC32, so a truncated or damaged file raises
    `CheckpointError` instead of loading silently wrong values. A folder that disappears (is
    renamed, deleted or replaced) between reads raises `CheckpointDeletedError`, not "damaged".

    Args:
        directory: The checkpoint folder.

    Raises:
        FileNotFoundError: The folder does not exist.
        NotADirectoryError: The path is a file.
        CheckpointError: The folder has no manifest (it is incomplete) or the manifest is bad.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = pathlib.Path(directory)
        try:
            found = os.stat(self._path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"Checkpoint folder {str(self._path)!r} does not exist. Check the path, or pass "
                "the folder of a checkpoint that save_state wrote."
            ) from None
        if not stat.S_ISDIR(found.st_mode):
            raise NotADirectoryError(
                f"Checkpoint path {str(self._path)!r} is a file. Pass the folder that holds "
                f"{MANIFEST_NAME}."
            )
        # Which folder this is: one renamed away and replaced under the same name is another.
        self._identity = (found.st_dev, found.st_ino)
        self._held: dict[str, BinaryIO] = {}
        with self._unless_deleted():
            if not (self._path / MANIFEST_NAME).is_file():
                raise CheckpointError(
                    f"Checkpoint folder {str(self._path)!r} is incomplete: it has no {MANIFEST_NAME}, "
                    "so its save was interrupted or fittrain did not write it. Load an earlier one."
                )
            self._files = _parse_manifest(self._path / MANIFEST_NAME)

    def _is_still_there(self) -> bool:
        try:
            found = os.stat(self._path)
        except OSError:
            return False
        return (found.st_dev, found.st_ino) == self._identity

    @contextlib.contextmanager
    def _unless_deleted(self) -> Iterator[None]:
        """Turns a failed read into `CheckpointDeletedError` when the folder has gone meanwhile.

        Pruning renames a folder away before deleting it, so a reader that lost the race sees
        missing files; that is not damage, and the folder must not be reported as damaged. Any
        failure counts, not only an OSError: a parser that finds its file gone mid-read raises
        its own error (torch: a RuntimeError "Unable to open file ... in read-only mode").
        """
        try:
            yield
        except Exception as err:
            if isinstance(err, CheckpointDeletedError) or self._is_still_there():
                raise
            raise CheckpointDeletedError(
                f"Checkpoint folder {str(self._path)!r} was deleted or replaced while it was being "
                "read, most likely by a run that saves with `total_limit` and pruned it. Nothing was "
                "loaded from it. Load a newer checkpoint: load_state() or resume_from='latest' picks "
                "the newest intact one."
            ) from err

    @property
    def path(self) -> pathlib.Path:
        """The checkpoint folder."""
        return self._path

    def names(self) -> list[str]:
        """Returns the names of the files listed in the manifest, sorted."""
        return sorted(self._files)

    def has(self, name: str) -> bool:
        """Returns whether the manifest lists a file called `name`."""
        return name in self._files

    def size(self, name: str) -> int | None:
        """Returns the size in bytes the manifest lists for `name`, or None when it is not listed."""
        entry = self._files.get(name)
        return None if entry is None else entry["size"]

    def _file(self, name: str) -> pathlib.Path:
        if name not in self._files:
            raise CheckpointError(
                f"Checkpoint folder {str(self._path)!r} has no file {name!r} in its manifest. "
                f"It has: {self.names()}."
            )
        path = self._path / name
        if not path.is_file():
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} is listed in the manifest but missing on disk. "
                "The checkpoint is damaged; load an earlier one."
            )
        return path

    def hold(self, names: Iterable[str]) -> None:
        """Opens listed files and keeps them open until `close`, so that they stay readable (the same
        files, whole) if the folder is pruned or replaced meanwhile. A sharded load holds its shard
        files before it verifies them and reads them long after, into the live model.

        At most `HOLD_MAX` files are held (a file descriptor each); the rest are opened when read.

        Raises:
            CheckpointError: A file is not listed or is missing (CheckpointDeletedError: the folder
                was deleted or replaced meanwhile).
        """
        for name in names:
            if len(self._held) >= HOLD_MAX:
                return
            if name not in self._held:
                with self._unless_deleted():
                    self._held[name] = open(self._file(name), "rb", buffering=0)  # noqa: SIM115 - closed by close()

    @property
    def held(self) -> dict[str, BinaryIO]:
        """The open files `hold` keeps, by manifest name."""
        return dict(self._held)

    def close(self) -> None:
        """Closes the files `hold` opened."""
        held, self._held = self._held, {}
        for file in held.values():
            file.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, path: pathlib.Path, size: int, crc: int) -> None:
        expected = self._files[path.relative_to(self._path).as_posix()]
        if size != expected["size"]:
            problem = f"expected {expected['size']} bytes, found {size}"
        elif crc != expected["crc32"]:
            problem = f"checksum mismatch (crc32 {crc}, expected {expected['crc32']})"
        else:
            return
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is damaged: {problem}. Load an earlier checkpoint."
        )

    def _verified(self, name: str) -> pathlib.Path:
        """Checks a file's size and CRC32 against the manifest and returns its path."""
        with self._unless_deleted():
            path = self._file(name)
            self._check(path, *file_checksum(path, self._files[name]["size"]))
        return path

    def _decode(self, name: str, decode: Callable[[pathlib.Path], Any], refusal: str) -> Any:
        """Checks a file's size and CRC32, then parses it with `decode`, naming the file if that fails.

        The checksum pass reads a large file in parts on threads (`crc.file_checksum`); `decode`
        then parses the file, whose pages that pass just brought into the page cache.
        """
        path = self._verified(name)
        try:
            with self._unless_deleted():
                return decode(path)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} {refusal}. Detail: {brief(err)}"
            ) from err

    def read_bytes(self, name: str) -> bytes:
        """Reads a file once, checks its size and checksum, and returns its contents.

        A file whose size differs from the manifest's is refused without being read.

        Args:
            name: A file name listed in the manifest.

        Raises:
            CheckpointError: The file is not listed, is missing, or is damaged.
        """
        with self._unless_deleted():
            path = self._file(name)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self._files[name]["size"]:
                    self._check(path, size, 0)  # raises: a file of the wrong size is not read
                data = f.read()
            self._check(path, len(data), crc32(data))
        return data

    def read_tensors(self, name: str, owned: bool = True) -> dict[str, torch.Tensor]:
        """Reads a verified safetensors file and returns its tensors, by key, on the CPU.

        The file's checksum is checked before safetensors parses it.

        Args:
            name: A safetensors file name listed in the manifest.
            owned: Copy the tensors into memory of their own (see `read_torch`). False leaves them
                in a memory map of the file, read on first use: for a caller that copies them into
                live tensors at once and keeps none (a model's load_state_dict), it saves a copy.

        Raises:
            CheckpointError: The file is damaged or is not a safetensors file.
        """
        own = _owned if owned else _as_is
        return self._decode(
            name, lambda path: own(safetensors.torch.load_file(path, device="cpu")),
            "is not a valid safetensors file; load an earlier checkpoint",
        )

    def read_torch(self, name: str, owned: bool = True) -> Any:
        """Reads a verified `torch.save` file with ``weights_only=True`` and returns its object.

        The file's checksum is checked before it is parsed. Tensors are on the CPU in memory of
        their own, copied out of a memory map of the file: since a tensor kept by a live object (an
        optimizer's state) would hold the file's disk space after the folder is pruned.

        Args:
            name: A file name listed in the manifest.
            owned: False leaves the tensors in the memory map, for a caller that makes them its own
                itself (`restore.own_optimizer_state` copies them into live tensors).

        Raises:
            CheckpointError: The file is damaged or holds more than plain tensors and
                containers. Such a file is refused, and nothing in it is executed.
        """
        own = _owned if owned else _as_is
        return self._decode(
            name,
            lambda path: own(torch.load(path, weights_only=True, map_location="cpu", mmap=_MMAP)),
            "was refused: it is not a plain-tensor file that torch.load(weights_only=True) "
            "accepts, so it was never executed. Save only tensors, numbers, strings, lists "
            "and dicts",
        )

    def read_json(self, name: str) -> Any:
        """Reads a verified JSON file and returns the decoded value.

        Args:
            name: A JSON file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged, too large (over 64 MiB), nested too deeply
                (over 32 levels) or not valid JSON.
        """
        size = self._files.get(name, {}).get("size", 0)
        if size > _JSON_MAX_BYTES:  # refused before reading it
            raise _json_error(self._path / name, f"{size} bytes, more than the {_JSON_MAX_BYTES} allowed")
        return _parse_json(self.read_bytes(name), self._path / name)

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Checks the size and checksum of every file in the manifest (or of `names` only).

        Raises:
            CheckpointError: Naming the first file that is missing or damaged.
            CheckpointDeletedError: The folder was deleted or replaced meanwhile.
        """
        for name in self.names() if names is None else names:
            self._verified(name)


def is_intact(directory: str | os.PathLike[str]) -> bool:
    """Returns whether a folder is a complete checkpoint whose files all match the manifest.

    Args:
        directory: The checkpoint folder.

    Returns:
        True when the manifest exists and every listed file matches; False otherwise.
    """
    try:
        CheckpointReader(directory).verify()
    except (CheckpointError, OSError):
        return False
    return True
