"""Crash-safe checkpoint folders with a checksummed manifest, and verified reads.

A folder is written under a temporary sibling name, gets ``manifest.json`` last, and is renamed
into place, so a folder without a manifest is never complete. The manifest's sizes and CRC32s
catch damaged files. Reads use only safetensors, JSON or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import safetensors.torch
import torch

MANIFEST_NAME = "manifest.json"
_FORMAT = "fittrain-checkpoint"
_VERSION = 1
_CHUNK = 16 * 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint folder is incomplete, damaged or unsafe; the message names the bad file."""


def _no_barrier() -> None:
    """Does nothing: the barrier of a single process."""


def _is_plain_name(name: Any) -> bool:
    """Whether a file name stays inside its folder and does not clash with the manifest."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST_NAME)
            and "/" not in name and "\\" not in name)


def _fsync_dir(directory: pathlib.Path) -> None:
    """Makes a folder's entries (created or renamed files) durable."""
    if os.name == "nt":  # Windows cannot open a folder for fsync; NTFS renames are journaled.
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checksum_file(path: pathlib.Path) -> tuple[int, int]:
    """Returns the size and CRC32 of a file, reading it in chunks to bound memory."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


def _brief(err: BaseException) -> str:
    """The line of an error that says what went wrong, without torch's advice to unpickle."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    unpickler = [line for line in lines if "WeightsUnpickler error" in line]
    return (unpickler or lines or [type(err).__name__])[0]


def _saveable_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


class CheckpointWriter:
    """Collects files for one checkpoint folder being written in a temporary sibling folder.

    `atomic_checkpoint` creates the writer; each process writes only its own files. Every write
    is flushed and fsynced, and its size and CRC32 are recorded for the manifest.

    Args:
        directory: The temporary folder being written. It must exist already.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._path = pathlib.Path(directory)
        self._records: dict[str, dict[str, int]] = {}

    @property
    def path(self) -> pathlib.Path:
        """The temporary folder being written."""
        return self._path

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Writes raw bytes as one file and records its size and checksum.

        Args:
            name: A plain file name inside the checkpoint folder.
            data: The file's full contents.

        Raises:
            ValueError: `name` has folders in it or is the manifest's name.
        """
        if not _is_plain_name(name):
            raise ValueError(
                "A checkpoint file name must be a plain file name without folders, other than "
                f"{MANIFEST_NAME!r}. Received: name={name!r}. Pass a name such as 'optimizer.pt'."
            )
        view = memoryview(data).cast("B")
        with open(self._path / name, "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        self._records[name] = {"size": view.nbytes, "crc32": zlib.crc32(view)}

    def write_tensors(
        self, name: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
    ) -> None:
        """Writes tensors as a safetensors file.

        Tensors are moved to the CPU and made contiguous; tied tensors are written as copies.

        Args:
            name: A plain file name, such as 'model.safetensors'.
            tensors: The tensors, by key.
            metadata: Optional string metadata stored in the safetensors header.

        Raises:
            TypeError: A value is not a tensor.
        """
        self.write_bytes(name, safetensors.torch.save(_saveable_tensors(tensors), metadata))

    def write_torch(self, name: str, obj: Any) -> None:
        """Writes an object with `torch.save`.

        The object must load with ``torch.load(weights_only=True)``: tensors, dicts, lists,
        tuples, numbers, strings and None. Anything else is refused when it is read back.

        Args:
            name: A plain file name, such as 'optimizer.pt'.
            obj: The object to save.
        """
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self.write_bytes(name, buffer.getbuffer())

    def write_json(self, name: str, obj: Any) -> None:
        """Writes a JSON-serializable object as indented, key-sorted JSON.

        Args:
            name: A plain file name, such as 'trainer_state.json'.
            obj: The object to save.
        """
        self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True).encode("utf-8"))


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
        size, crc = _checksum_file(entry)
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
    barrier: Callable[[], None] = _no_barrier,
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
    except BaseException:
        # No barrier here: the other processes may never reach it, and the error must surface.
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

    def _decode(self, name: str, decode: Callable[[bytes], Any], refusal: str) -> Any:
        data = self.read_bytes(name)
        try:
            return decode(data)
        except Exception as err:
            raise CheckpointError(
                f"Checkpoint file {str(self._path / name)!r} {refusal}. Detail: {_brief(err)}"
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

        Args:
            name: A safetensors file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or is not a safetensors file.
        """
        return self._decode(
            name, safetensors.torch.load,
            "is not a valid safetensors file; load an earlier checkpoint",
        )

    def read_torch(self, name: str) -> Any:
        """Reads a verified `torch.save` file with ``weights_only=True`` and returns its object.

        Tensors are loaded onto the CPU.

        Args:
            name: A file name listed in the manifest.

        Raises:
            CheckpointError: The file is damaged or holds more than plain tensors and
                containers. Such a file is refused, and nothing in it is executed.
        """
        return self._decode(
            name,
            lambda data: torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"),
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
        return self._decode(name, json.loads, "is not valid JSON; load an earlier checkpoint")

    def verify(self) -> None:
        """Checks the size and checksum of every file in the manifest.

        Raises:
            CheckpointError: Naming the first file that is missing or damaged.
        """
        for name in self.names():
            path = self._file(name)
            self._check(path, *_checksum_file(path))


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
