"""Crash-safe checkpoint folders with a checksummed manifest, and verified reads.

A folder is written under a temporary sibling name, gets ``manifest.json`` last, and is renamed
into place, so a folder without a manifest is never complete. The manifest's sizes and CRC32s
catch damaged files. Reads use only safetensors, JSON or ``torch.load(weights_only=True)``.

Files are streamed to disk once, checksummed as they are written (see `fittrain.fastio`), and
fsynced on background threads that every process joins before the folder is renamed. A read
checks a file's size and CRC32 over a memory map before anything parses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
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

__all__ = [
    "MANIFEST_NAME", "CheckpointError", "CheckpointReader", "CheckpointWriter",
    "atomic_checkpoint", "is_intact", "list_checkpoints",
]

_FORMAT = "fittrain-checkpoint"
_VERSION = 1
# Memory-mapped torch.load keeps a file's inode alive while its tensors live; on Windows that
# would also stop old checkpoints from being deleted, so it copies there instead.
_MMAP_TORCH_LOAD = os.name != "nt"


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, damaged or unsafe; the message names the bad file."""


def no_barrier() -> None:
    """Does nothing: the barrier of a single process."""


def _fsync_dir(directory: pathlib.Path) -> None:
    """Makes a folder's entries (created or renamed files) durable."""
    if os.name == "nt":  # Windows cannot open a folder for fsync; NTFS renames are journaled.
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        if entry.name in files or entry.name == MANIFEST_NAME:
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


def _move_into_place(temp: pathlib.Path, final: pathlib.Path) -> None:
    """Replaces `final` with `temp` so a complete folder always exists under some name."""
    old = final.parent / f".{final.name}.old"
    if final.exists():
        # A leftover `.old` beside an existing final folder is from an interrupted swap whose
        # new folder did land, so it is garbage; the rename below needs the name free.
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    try:
        os.rename(temp, final)
    except OSError:
        if old.exists() and not final.exists():
            os.rename(old, final)  # Put the previous checkpoint back under its name.
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_checkpoint(
    final_dir: str | os.PathLike[str], *, is_main_process: bool = True,
    barrier: Callable[[], None] = no_barrier,
) -> Iterator[CheckpointWriter]:
    """Writes a checkpoint folder that appears under its name only when complete.

    Every process calls this with the same `final_dir` and writes its own files through the
    writer it gets. The folder is built as the sibling ``.{name}.tmp``; on success the main
    process writes the manifest last and renames the folder into place. On an exception the
    main process removes the temporary folder and the exception propagates unchanged.

    Args:
        final_dir: The checkpoint folder to create or replace.
        is_main_process: Whether this process creates, finishes and renames the folder.
        barrier: A collective barrier across processes; a no-op for a single process.

    Returns:
        A context manager that yields a `CheckpointWriter` for the temporary folder.

    Example:
        >>> with atomic_checkpoint("ckpt/checkpoint_0") as writer:
        ...     writer.write_json("trainer_state.json", {"global_step": 10})
    """
    final = pathlib.Path(os.path.abspath(final_dir))
    temp = final.parent / f".{final.name}.tmp"
    if is_main_process:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
    barrier()
    writer = CheckpointWriter(temp)
    try:
        yield writer
        # Each process's files are on disk before the main process may rename the folder.
        writer._wait_durable()
    except BaseException:
        # No barrier here: the other processes may never reach it, and the error must surface.
        with contextlib.suppress(OSError):
            writer._wait_durable()
        if is_main_process:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    barrier()
    if is_main_process:
        _write_manifest(writer)
        _move_into_place(temp, final)
    barrier()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_manifest(path: pathlib.Path) -> dict[str, dict[str, int]]:
    """Reads and validates a manifest, returning its file records."""
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"Cannot read {path}: {err}. Load an earlier checkpoint.") from err
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
            f"{manifest!r:.300}. The checkpoint is damaged or was written by another version; "
            "load an earlier checkpoint or use the fittrain that wrote it."
        )
    return files


class CheckpointReader:
    """Reads files of a complete checkpoint folder, checking each against the manifest.

    Every read checks the file's size and CRC32, so a truncated or damaged file raises
    `CheckpointError` instead of loading silently wrong values.

    Args:
        directory: The checkpoint folder.

    Raises:
        FileNotFoundError: The folder does not exist.
        NotADirectoryError: The path is a file.
        CheckpointError: The folder has no manifest (it is incomplete) or the manifest is bad.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = pathlib.Path(directory)
        if not self._path.exists():
            raise FileNotFoundError(
                f"Checkpoint folder {str(self._path)!r} does not exist. Check the path, or pass "
                "the folder of a checkpoint that save_state wrote."
            )
        if not self._path.is_dir():
            raise NotADirectoryError(
                f"Checkpoint path {str(self._path)!r} is a file. Pass the folder that holds "
                f"{MANIFEST_NAME}."
            )
        if not (self._path / MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"Checkpoint folder {str(self._path)!r} is incomplete: it has no {MANIFEST_NAME}, "
                "so its save was interrupted or fittrain did not write it. Load an earlier one."
            )
        self._files = _parse_manifest(self._path / MANIFEST_NAME)

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
        path = self._file(name)
        self._check(path, *file_checksum(path, self._files[name]["size"]))
        return path

    def _decode(self, name: str, decode: Callable[[pathlib.Path], Any], refusal: str) -> Any:
        """Verifies a file, then parses it with `decode`, naming the file if parsing fails."""
        path = self._verified(name)
        try:
            return decode(path)
        except Exception as err:
            raise CheckpointError(
                f"Checkpoint file {str(path)!r} {refusal}. Detail: {_brief(err)}"
            ) from err

    def read_bytes(self, name: str) -> bytes:
        """Reads a file once, checks its size and checksum, and returns its contents.

        Args:
            name: A file name listed in the manifest.

        Raises:
            CheckpointError: The file is not listed, is missing, or is damaged.
        """
        path = self._file(name)
        data = path.read_bytes()
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
            name, lambda path: safetensors.torch.load_file(path, device="cpu"),
            "is not a valid safetensors file; load an earlier checkpoint",
        )

    def read_torch(self, name: str) -> Any:
        """Reads a verified `torch.save` file with ``weights_only=True`` and returns its object.

        The file's checksum is checked before it is parsed. Tensors are on the CPU and, except
        on Windows, memory-mapped from the file (``torch.load(mmap=True)``, copy-on-write):
        their pages are read on first use and writing to them never changes the file. A mapping
        lives as long as a tensor from it; the file can still be deleted or renamed meanwhile.

        Args:
            name: A file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or holds more than plain tensors and
                containers. Such a file is refused, and nothing in it is executed.
        """
        return self._decode(
            name,
            lambda path: torch.load(path, weights_only=True, map_location="cpu",
                                    mmap=_MMAP_TORCH_LOAD),
            "was refused: it is not a plain-tensor file that torch.load(weights_only=True) "
            "accepts, so it was never executed. Save only tensors, numbers, strings, lists "
            "and dicts",
        )

    def read_json(self, name: str) -> Any:
        """Reads a verified JSON file and returns the decoded value.

        Args:
            name: A JSON file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or is not valid JSON.
        """
        data = self.read_bytes(name)
        try:
            return json.loads(data)
        except ValueError as err:
            raise CheckpointError(
                f"Checkpoint file {str(self._path / name)!r} is not valid JSON; load an earlier "
                f"checkpoint. Detail: {_brief(err)}"
            ) from err

    def verify(self) -> None:
        """Checks the size and checksum of every file in the manifest.

        Raises:
            CheckpointError: Naming the first file that is missing or damaged.
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
