"""Crash-safe checkpoint folders with a checksummed manifest, and verified reads.

A folder is written under a temporary sibling name, gets ``manifest.json`` last, and is renamed
into place, so a folder without a manifest is never complete. The manifest's sizes and CRC32s
catch damaged files. Reads use only safetensors, JSON or ``torch.load(weights_only=True)``.

Files are streamed to disk once, checksummed as they are written (see `fittrain.fastio`), and
fsynced on background threads that every process joins before the folder is renamed. A read
takes a file into memory once and checks its size and CRC32 before anything parses it; nothing
loaded keeps a checkpoint's file open or mapped, so a pruned folder frees its disk space at once.
JSON is parsed with limits on size and nesting, so a hostile file is a damaged one, never a crash.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import re
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import safetensors.torch
import torch

from fittrain.fastio import (
    MANIFEST_NAME,
    CheckpointWriter,
    _is_plain_name,
    file_checksum,
    saveable_tensors,
)
from fittrain.renames import commit_replacing, fsync_dir as _fsync_dir, rename_noreplace
from fittrain.temp_folders import (
    WRITER_MARKER,
    TempFolder,
    describe_owner,
    raise_if_no_space as _raise_if_no_space,
)

__all__ = [
    "MANIFEST_NAME", "CheckpointDeletedError", "CheckpointError", "CheckpointReader",
    "CheckpointWriter", "atomic_checkpoint", "is_intact", "list_checkpoints",
]

_FORMAT = "fittrain-checkpoint"
_VERSION = 1
# Limits for the JSON files of a checkpoint (the manifest, accelerator_state.json). Real ones are
# tiny and three levels deep; the caps keep a hostile file from exhausting memory or the stack.
_JSON_MAX_BYTES = 64 * 1024 * 1024
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
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        owned = {key: _owned(value) for key, value in obj.items()}
        return owned if type(obj) is dict else type(obj)(owned)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_owned(value) for value in obj)
    return obj


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, damaged or unsafe; the message names the bad file."""


class CheckpointDeletedError(CheckpointError):
    """A checkpoint folder was deleted or replaced while it was being read (such as by pruning)."""


def no_barrier() -> None:
    """Does nothing: the barrier of a single process."""


def _brief(err: BaseException) -> str:
    """The line of an error that says what went wrong, without torch's advice to unpickle."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    unpickler = [line for line in lines if "WeightsUnpickler error" in line]
    return (unpickler or lines or [type(err).__name__])[0]


# Kept under its old name for the modules that import it from here.
_saveable_tensors = saveable_tensors


def _write_manifest(writer: CheckpointWriter) -> None:
    """Checksums other processes' files, then writes and fsyncs the manifest last."""
    files = dict(writer._records)
    for entry in sorted(writer.path.iterdir()):
        if entry.name in files or entry.name in (MANIFEST_NAME, WRITER_MARKER):
            continue
        if not entry.is_file():
            raise CheckpointError(
                f"Checkpoint folder {writer.path} holds {entry.name!r}, which is not a plain file. "
                "Checkpoint files must be written with the CheckpointWriter's write_* methods."
            )
        size, crc = file_checksum(entry)
        files[entry.name] = {"size": size, "crc32": crc}
    manifest = {"format": _FORMAT, "version": _VERSION, "files": dict(sorted(files.items()))}
    with open(writer.path / MANIFEST_NAME, "wb") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(writer.path)


def _move_into_place(temp: pathlib.Path, final: pathlib.Path, replace: bool = True) -> None:
    """Renames the finished folder `temp` to `final`; a complete folder is there at every moment.

    Args:
        replace: Swap out a folder already named `final`. Under automatic naming it is False: a
            reserved number is never taken by anyone else, and the commit never replaces one.
    """
    if replace:
        commit_replacing(temp, final)
        return
    try:
        rename_noreplace(temp, final)
    except FileExistsError:
        raise CheckpointError(
            f"Checkpoint folder {str(final)!r} appeared while this save was writing it, so the save "
            "was not kept: under automatic naming a save never replaces a folder. Another program "
            "wrote that name; save again to use the next number."
        ) from None
    _fsync_dir(final.parent)


def _claim(final: pathlib.Path) -> TempFolder:
    """Claims ``.{name}.tmp`` beside `final`, refusing while another live writer holds it."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.parent / f".{final.name}.tmp"
        owned = TempFolder.claim(temp)
    except OSError as err:
        _raise_if_no_space(err, final)
        raise
    if owned is None:
        raise CheckpointError(
            f"Cannot save checkpoint folder {str(final)!r}: {describe_owner(temp)} is writing it "
            f"right now (it holds {str(temp)!r}), and two writers of one folder would mix their "
            f"files. Give each run its own folder; if that process no longer runs, delete {str(temp)!r}."
        )
    return owned


def _check_replaceable(final: pathlib.Path) -> None:
    if os.path.lexists(final) and not final.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"Cannot save checkpoint folder {str(final)!r}: a file of that name exists, and a save "
            "never deletes a file. Pass a new path, or the path of an existing checkpoint folder.",
        )


def _commit(writer: CheckpointWriter, owned: TempFolder, final: pathlib.Path, replace: bool) -> None:
    """Writes the manifest and renames the folder into place; any failure removes the folder."""
    try:
        _write_manifest(writer)
        _move_into_place(owned.path, final, replace)
    except BaseException as err:
        owned.release()
        _raise_if_no_space(err, final)
        raise
    owned.mark_committed()
    with contextlib.suppress(OSError):
        os.unlink(final / WRITER_MARKER)  # only now: until the commit it marks a live writer


@contextlib.contextmanager
def atomic_checkpoint(
    final_dir: str | os.PathLike[str], *, is_main_process: bool = True,
    barrier: Callable[[], None] = no_barrier, reserved: TempFolder | None = None,
) -> Iterator[CheckpointWriter]:
    """Writes a checkpoint folder that appears under its name only when complete.

    Every process calls this with the same `final_dir` and writes its own files through the
    writer it gets. The folder is built as the sibling ``.{name}.tmp``, which the main process
    claims (`fittrain.temp_folders`): a live writer's folder is never taken over, one left by a
    dead writer is cleaned up. On success the main process writes the manifest last and renames
    the folder into place. On any failure the main process removes the temporary folder; a full
    disk is raised as an OSError naming the folder, any other exception propagates unchanged.

    Args:
        final_dir: The checkpoint folder to create or replace.
        is_main_process: Whether this process creates, finishes and renames the folder.
        barrier: A collective barrier across processes; a no-op for a single process.
        reserved: On the main process, the temporary folder that
            `temp_folders.reserve_numbered` claimed for `final_dir`; the commit then never
            replaces an existing folder. Without it the main process claims the folder here and
            the commit replaces `final_dir`.

    Returns:
        A context manager that yields a `CheckpointWriter` for the temporary folder.

    Example:
        >>> with atomic_checkpoint("ckpt/checkpoint_0") as writer:
        ...     writer.write_json("trainer_state.json", {"global_step": 10})
    """
    final = pathlib.Path(os.path.abspath(final_dir))
    _check_replaceable(final)
    owned = reserved  # the main process's claim; None on the others
    if is_main_process and owned is None:
        owned = _claim(final)
    barrier()
    writer = CheckpointWriter(final.parent / f".{final.name}.tmp")
    try:
        yield writer
        # Each process's files are on disk before the main process may rename the folder.
        writer._wait_durable()
    except BaseException as err:
        # No barrier here: the other processes may never reach it, and the error must surface.
        with contextlib.suppress(OSError):
            writer._wait_durable()
        if owned is not None:
            owned.release()
        _raise_if_no_space(err, final)
        raise
    barrier()
    if owned is not None:
        _commit(writer, owned, final, replace=reserved is None)
    barrier()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        raise _json_error(path, "nested too deeply" if isinstance(err, RecursionError) else _brief(err)) from None
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
        and manifest.get("format") == _FORMAT and manifest.get("version") == _VERSION
        and all(_is_plain_name(name) and isinstance(record, dict) and _is_count(record.get("size"))
                and _is_count(record.get("crc32")) for name, record in files.items())
    )
    if not valid:
        raise CheckpointError(
            f"{path} is not a valid version-{_VERSION} fittrain manifest. Received: "
            f"{_short(manifest)}. The checkpoint is damaged or was written by another version; "
            "load an earlier checkpoint or use the fittrain that wrote it."
        )
    return files


def _short(value: Any) -> str:
    """A repr of at most 300 characters of a (depth-checked) decoded JSON value."""
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


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
        missing files; that is not damage, and the folder must not be reported as damaged.
        """
        try:
            yield
        except (CheckpointError, OSError) as err:
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

    def _check(self, path: pathlib.Path, size: int, crc: int) -> None:
        expected = self._files[path.name]
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

        The checksum is computed over a memory map of the file (no copy); `decode` then reads
        the file straight into the memory its result keeps, so a large file is copied once.
        """
        path = self._verified(name)
        try:
            with self._unless_deleted():
                return decode(path)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} {refusal}. Detail: {_brief(err)}"
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
            self._check(path, len(data), zlib.crc32(data))
        return data

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Reads a verified safetensors file and returns its tensors, by key, on the CPU.

        The file's checksum is checked before safetensors parses it.

        Args:
            name: A safetensors file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or is not a safetensors file.
        """
        return self._decode(
            name, lambda path: _owned(safetensors.torch.load_file(path, device="cpu")),
            "is not a valid safetensors file; load an earlier checkpoint",
        )

    def read_torch(self, name: str) -> Any:
        """Reads a verified `torch.save` file with ``weights_only=True`` and returns its object.

        The file's checksum is checked before it is parsed. Tensors are on the CPU in memory of
        their own, copied out of a memory map of the file: since a tensor kept by a live object (an
        optimizer's state) would hold the file's disk space after the folder is pruned.

        Args:
            name: A file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or holds more than plain tensors and
                containers. Such a file is refused, and nothing in it is executed.
        """
        return self._decode(
            name,
            lambda path: _owned(torch.load(path, weights_only=True, map_location="cpu", mmap=_MMAP)),
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

    def verify(self) -> None:
        """Checks the size and checksum of every file in the manifest.

        Raises:
            CheckpointError: Naming the first file that is missing or damaged.
            CheckpointDeletedError: The folder was deleted or replaced meanwhile.
        """
        for name in self.names():
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


def list_checkpoints(
    root: str | os.PathLike[str], prefix: str = "checkpoint_"
) -> list[pathlib.Path]:
    """Lists the folders named ``{prefix}{int}`` directly under `root`, oldest first.

    Temporary folders and other names are ignored. Complete and incomplete folders are both
    listed; use `is_intact` to pick a loadable one.

    Args:
        root: The folder holding the checkpoints.
        prefix: The name before the number.

    Returns:
        The folders, sorted by their number ascending; empty when `root` does not exist.
    """
    pattern = re.compile(re.escape(prefix) + r"([0-9]+)")
    root_path = pathlib.Path(root)
    if not root_path.is_dir():
        return []
    found = []
    for entry in root_path.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not entry.name.startswith(".") and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]
