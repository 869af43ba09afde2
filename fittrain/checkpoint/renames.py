"""Renames that never leave a checkpoint's name empty, and removal of a folder through a handle.

A new folder is renamed in without replacing anything (``renameat2(RENAME_NOREPLACE)``), and an
existing one is swapped with its replacement in one step (``renameat2(RENAME_EXCHANGE)``, glibc
2.28+), then deleted. Where those are missing, plain renames are the fallback (see
`_rename_twice_into_place`). A folder that another writer may take the name of is deleted
through a handle on it (`remove_folder_at`), never by its name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pathlib
import shutil
from typing import Any

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# renameat2 flags a file system does not support give EINVAL; ENOSYS means an old kernel.
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
_OCCUPIED = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def _load_renameat2() -> Any:
    """glibc's `renameat2`, or None where the C library lacks it (musl before 1.2.5, macOS)."""
    if os.name != "posix":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()  # a constant handle, looked up once


def _renameat2(src: pathlib.Path, dst: pathlib.Path, flags: int) -> bool:
    """One renameat2 system call; False when this system or file system does not offer it.

    Raises:
        OSError: The rename itself failed, as `os.rename` would raise it.
    """
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))


def exchange(first: pathlib.Path, second: pathlib.Path) -> bool:
    """Swaps two existing paths atomically: each name refers to an entry at every moment.

    Returns:
        False, having changed nothing, where renameat2(RENAME_EXCHANGE) is unavailable (NFS,
        other kernels); the caller then falls back to two renames.
    """
    return _renameat2(first, second, _RENAME_EXCHANGE)


def rename_noreplace(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Renames `src` to `dst`, failing with FileExistsError instead of replacing anything.

    Without RENAME_NOREPLACE, a plain rename still refuses a non-empty folder at `dst`; only an
    empty folder that appears after the check can be replaced, and an empty folder holds nothing.
    """
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        os.rename(src, dst)
    except OSError as err:
        if err.errno in _OCCUPIED and not isinstance(err, FileExistsError):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst)) from err
        raise


def fsync_dir(directory: pathlib.Path) -> None:
    """Makes a folder's entries (created or renamed files) durable."""
    if os.name == "nt":  # Windows cannot open a folder for fsync; NTFS renames are journaled.
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_replacing(temp: pathlib.Path, final: pathlib.Path) -> None:
    """Puts the folder `temp` under the name `final`, replacing whatever folder is there.

    A complete folder is under `final` at every moment: a new name is taken by one rename, an
    existing folder is swapped out in one step and deleted afterwards.
    """
    old = final.parent / f".{final.name}.old"
    if final.is_dir():
        # A leftover `.old` beside an existing final folder is from an interrupted fallback
        # swap whose new folder did land, so it is garbage.
        shutil.rmtree(old, ignore_errors=True)
    try:
        rename_noreplace(temp, final)
    except FileExistsError:
        if not _swap_into_place(temp, final):
            _rename_twice_into_place(temp, final, old)
    fsync_dir(final.parent)


def _swap_into_place(temp: pathlib.Path, final: pathlib.Path) -> bool:
    """Exchanges `temp` with the existing `final` in one step, then deletes the old folder.

    Returns:
        False, having changed nothing, where the exchange is unavailable.
    """
    if os.name != "posix":
        return False
    if os.path.islink(final):  # a link (such as `latest`) is replaced, never its target's files
        if not exchange(temp, final):
            return False
        with contextlib.suppress(OSError):
            os.unlink(temp)  # fails for a folder, so never removes another writer's
        return True
    fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not exchange(temp, final):
            return False
        fsync_dir(final.parent)  # the swap is durable before the old files go
        remove_folder_at(fd, temp)  # through the handle: `temp` may be another writer's by now
    finally:
        os.close(fd)
    return True


def _rename_twice_into_place(temp: pathlib.Path, final: pathlib.Path, old: pathlib.Path) -> None:
    """The fallback without RENAME_EXCHANGE (NFS, non-Linux systems, glibc before 2.28).

    Between its two renames `final` does not exist: a crash there leaves the previous folder
    only as ``.{name}.old``, which no reader looks for, and no `final`. Readers are not taught
    to recover it; where this matters, use a local file system that supports the exchange.
    """
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    try:
        os.rename(temp, final)
    except OSError:
        if old.exists() and not final.exists():
            os.rename(old, final)  # put the previous folder back under its name
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _empty_folder(folder_fd: int) -> None:
    """Deletes everything inside the folder open as `folder_fd`, whatever name it has now."""
    for name in os.listdir(folder_fd):
        try:
            os.unlink(name, dir_fd=folder_fd)
        except OSError:  # a folder: EISDIR on Linux, EPERM elsewhere
            with contextlib.suppress(OSError):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder_fd)
                try:
                    _empty_folder(fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=folder_fd)


def remove_folder_at(folder_fd: int, path: pathlib.Path) -> None:
    """Deletes the folder open as `folder_fd`, now found at `path`, never another folder there.

    Its contents go through the handle; the name goes only if the folder there is empty, which
    a live writer's folder never is.
    """
    _empty_folder(folder_fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)
