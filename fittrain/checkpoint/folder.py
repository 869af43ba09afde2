"""Crash-safe checkpoint folders: written under a temporary name, manifest last, renamed into place.

A folder is written under a temporary sibling name, gets ``manifest.json`` last, and is renamed
into place, so a folder without a manifest is never complete. The manifest's sizes and CRC32s
catch damaged files (`reader` checks them on every read).

Files are streamed to disk once, checksummed as they are written (see `fastio`), and fsynced on
background threads that every process joins before the folder is renamed. The temporary folder
is claimed by one writer (`temp_folders`); the rename never leaves the checkpoint's name empty
(`renames`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
from collections.abc import Callable, Iterator

from fittrain.checkpoint.crc import file_checksum
from fittrain.checkpoint.errors import CheckpointError
from fittrain.checkpoint.fastio import MANIFEST_NAME, CheckpointWriter
from fittrain.checkpoint.renames import commit_replacing, rename_noreplace
from fittrain.checkpoint.renames import fsync_dir as _fsync_dir
from fittrain.checkpoint.temp_folders import (
    WRITER_MARKER,
    TempFolder,
    describe_owner,
)
from fittrain.checkpoint.temp_folders import (
    raise_if_no_space as _raise_if_no_space,
)

# What a manifest says it is; `reader` refuses any other.
MANIFEST_FORMAT = "fittrain-checkpoint"
MANIFEST_VERSION = 1


def _listed_files(root: pathlib.Path) -> list[pathlib.Path]:
    """Every file below `root`, sorted; anything else (a link, a device) is refused."""
    found = []
    for entry in sorted(root.rglob("*")):
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            raise CheckpointError(
                f"Checkpoint folder {root} holds {entry.relative_to(root).as_posix()!r}, which is neither a plain file "
                "nor a folder. Checkpoint files are written by save_state (and plain files by its pre-hooks).")
        if entry.is_file():
            found.append(entry)
    return found


def no_barrier() -> None:
    """Does nothing: the barrier of a single process."""


def _write_manifest(writer: CheckpointWriter) -> None:
    """Checksums other processes' files (and those a save hook wrote, in subfolders too), then
    writes and fsyncs the manifest last."""
    files = dict(writer._records)
    for entry in _listed_files(writer.path):
        name = entry.relative_to(writer.path).as_posix()
        if name in files or name in (MANIFEST_NAME, WRITER_MARKER):
            continue
        size, crc = file_checksum(entry)
        files[name] = {"size": size, "crc32": crc}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}
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
    claims (`temp_folders`): a live writer's folder is never taken over, one left by a
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
