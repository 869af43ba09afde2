"""Temporary checkpoint folders, each owned by one writer from its creation to its commit.

Several writers may share a project folder: two jobs, or two Accelerators. Each writer builds a
checkpoint in a temporary sibling folder (``.checkpoint_3.tmp``) that it *claims*: the folder
appears under that name already holding a marker file naming its owner (host and process id),
because it is made under a private name and then renamed without replacing anything. A live
writer's folder is therefore never empty and always marked, so

- a claim fails, instead of destroying the other writer's files, while that writer lives;
- a folder whose marker names a dead process of this host (or that has no marker at all, as
  those of older versions) is left over by a crash and may be removed. It is emptied through
  a handle on that very folder and then removed only if empty, so a live writer's folder that
  took its name in the meantime is never touched. A folder of another host's writer cannot be
  checked, so it is left alone: automatic naming skips its number.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import secrets
import shutil
import socket
from typing import Any

from fittrain.checkpoint.renames import remove_folder_at, rename_noreplace

WRITER_MARKER = ".fittrain-writer.json"
# A full disk, or a full quota.
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def raise_if_no_space(err: BaseException, folder: pathlib.Path) -> None:
    """Re-raises a full disk as an OSError (same errno) whose message names the checkpoint folder.

    Returns:
        Only for any other error, which the caller re-raises unchanged.
    """
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
        file = f" (writing {os.path.basename(err.filename)})" if isinstance(err.filename, str) else ""
        raise OSError(
            err.errno,
            f"{os.strerror(err.errno)} while saving checkpoint folder {str(folder)!r}{file}. The "
            "partial folder was removed and earlier checkpoints are intact. Free space on that disk "
            "or save to another one, then save again.",
        ) from err


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _read_owner(folder_fd: int) -> dict[str, Any] | None:
    """The marker of the folder open as `folder_fd`; None when it has none or it is unreadable."""
    try:
        fd = os.open(WRITER_MARKER, os.O_RDONLY, dir_fd=folder_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as marker:
        try:
            owner = json.loads(marker.read(4096))
        except ValueError:
            return None
    return owner if isinstance(owner, dict) else None


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it there; never guess
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists under another user
        return True
    return True


def _is_stale(owner: dict[str, Any] | None) -> bool:
    """Whether a temporary folder's writer is gone. Another host's writer cannot be checked."""
    if owner is None:
        return True  # a live writer's folder always holds its marker
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    return pid != os.getpid() and not _pid_alive(pid)


def remove_if_stale(temp: pathlib.Path) -> bool:
    """Removes a temporary folder left by a dead writer.

    Returns:
        True when nothing is left at `temp`; False when a live (or unknown) writer owns it.
    """
    if os.name == "nt":  # no folder handles there: only a folder without a marker goes
        if not (temp / WRITER_MARKER).exists():
            shutil.rmtree(temp, ignore_errors=True)
        return not os.path.lexists(temp)
    try:
        fd = os.open(temp, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # a file, or unreadable: not ours to remove
    try:
        if not _is_stale(_read_owner(fd)):
            return False
        remove_folder_at(fd, temp)
    finally:
        os.close(fd)
    return not os.path.lexists(temp)


def describe_owner(temp: pathlib.Path) -> str:
    """Names the writer that holds `temp`, for error messages."""
    try:
        owner = json.loads((temp / WRITER_MARKER).read_bytes())
    except (OSError, ValueError):
        return "another writer"
    if not isinstance(owner, dict):
        return "another writer"
    return f"process {owner.get('pid')!r} on host {owner.get('host')!r}"


def _remove_dead_private_folders(temp: pathlib.Path) -> None:
    """Removes the private folders of claims of `temp` that a dead process of this host left.

    Their names hold host and process id and are never reused, so this cannot hit a live one.
    """
    head, tail = f"{temp.name}.", ".new"
    for name in os.listdir(temp.parent):
        if not (name.startswith(head) and name.endswith(tail)):
            continue
        host, pid, _ = (name[len(head):-len(tail)].rsplit("-", 2) + ["", ""])[:3]
        if pid.isdigit() and _is_stale({"host": host, "pid": int(pid)}):
            shutil.rmtree(temp.parent / name, ignore_errors=True)


class TempFolder:
    """A temporary checkpoint folder that this process claimed and owns until `release`.

    Attributes:
        path: The folder, such as ``.checkpoint_3.tmp``.
        number: The checkpoint number it was reserved for, under automatic naming.
    """

    def __init__(self, path: pathlib.Path, number: int | None = None) -> None:
        self.path = pathlib.Path(os.path.abspath(path))  # a later chdir must not move it
        self.number = number
        self._owned = True

    def mark_committed(self) -> None:
        """Notes that the folder was renamed into place: `release` then does nothing."""
        self._owned = False

    @classmethod
    def claim(cls, temp: pathlib.Path) -> "TempFolder | None":
        """Creates `temp`, marked as this process's; None when a live writer holds it.

        A folder left there by a dead writer is removed first.
        """
        for _ in range(3):  # a stale folder removed by someone else may be claimed by a third
            if cls._create(temp):
                return cls(temp)
            if not remove_if_stale(temp):
                return None
        return None

    @staticmethod
    def _create(temp: pathlib.Path) -> bool:
        """Makes the marked folder under a private name, then moves it to `temp` if free."""
        _remove_dead_private_folders(temp)
        private = temp.parent / f"{temp.name}.{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.new"
        private.mkdir()
        try:
            (private / WRITER_MARKER).write_bytes(json.dumps(_owner()).encode("utf-8"))
            rename_noreplace(private, temp)
            return True
        except FileExistsError:
            return False
        finally:
            shutil.rmtree(private, ignore_errors=True)  # gone after a successful rename

    def release(self) -> None:
        """Deletes the folder and everything in it, unless another live writer holds its name now.

        After a failure that is this writer's own folder; after a swap, the replaced folder.
        Only the first call (before any commit) does something.
        """
        if not self._owned:
            return
        self._owned = False
        if os.name == "nt":
            shutil.rmtree(self.path, ignore_errors=True)
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            owner = _read_owner(fd)
            if owner is None or owner == _owner() or _is_stale(owner):
                remove_folder_at(fd, self.path)
        finally:
            os.close(fd)


def reserve_numbered(root: pathlib.Path, prefix: str, start: int) -> TempFolder:
    """Claims the temporary folder of the first free checkpoint number from `start` on.

    A number is free when neither ``{prefix}{n}`` exists nor a live writer holds its temporary
    folder, so two writers in one folder never pick the same number.

    Returns:
        The claimed folder, with its `number`.
    """
    root.mkdir(parents=True, exist_ok=True)
    number = start
    while True:
        final = root / f"{prefix}{number}"
        if not os.path.lexists(final):
            claimed = TempFolder.claim(root / f".{prefix}{number}.tmp")
            if claimed is not None and not os.path.lexists(final):
                claimed.number = number
                return claimed
            if claimed is not None:  # committed by another writer just before the claim
                claimed.release()
        number += 1
