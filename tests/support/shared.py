"""A fixture's files made once per test run, not once per pytest-xdist worker.

A session- or module-scoped fixture runs once per worker that needs it: with `-n auto` a job
whose tests are spread over several workers would run on each of them. `shared_folder` makes the first worker to
ask fill the folder while the others wait for it (a file lock, with a timeout), and hands every
worker the same folder. Only for folders the tests read and never change.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import time
from typing import Callable

import pytest

#: How long a worker waits for another to fill a folder: longer than any job's own timeout (jobs.py).
WAIT_S = 900.0


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str,
                  fill: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """The folder `name` after `fill(folder)`, filled once per run and shared by every xdist worker
    (without xdist: a fresh folder of this session). A fill that raised leaves nothing behind: the
    next worker to ask fills it anew (and fails alike, naming the same cause)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        fill(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent  # this run's folder, the same for every worker
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        _acquire(lock.fileno(), name)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a fill that raised left
            folder.mkdir()
            fill(folder)
            done.touch()
    return folder


def _acquire(fd: int, name: str) -> None:
    """Takes the lock on `fd` (released when the file closes), failing the test after `WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"waited {WAIT_S:.0f} s for another test worker to make the shared folder {name!r}")
            time.sleep(0.2)
