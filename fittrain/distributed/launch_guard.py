"""Workers started by `fittrain launch` die with it, even when it is killed with SIGKILL.

torchrun starts each worker in a session of its own, so that it can signal a worker's whole
process tree. The other side of that: when the launcher itself dies without running any code
(SIGKILL from a scheduler's last resort, the OOM killer or `kill -9`), nothing stops the workers.
Such orphans went on training and writing checkpoints into the project that the resumed run was
also using: a silent second writer.

So the launcher exports its pid (`launcher_environment`), and each worker, when fittrain builds its
process state, arranges to die with it (`guard_worker`):

- On Linux, `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills the worker the moment its
  parent dies, with no polling and even while the worker is stuck in a collective. The signal
  fires when the *thread* that forked the worker ends. torchrun's agent starts its workers
  (`subprocess.Popen`) in the thread that runs its monitoring loop, which is the launcher's main
  thread and lives until the job is over, so here that thread's end is the launcher's end.
  `getppid()` is checked once more afterwards, which closes the race in which the launcher died
  between starting the worker and the `prctl`.
- Elsewhere (macOS has no `prctl`), or if `prctl` fails, a daemon thread polls `getppid()`
  every second (`watch_parent`): an orphan is re-parented, so its parent pid changes.

SIGKILL, not SIGTERM: SIGTERM would make the Trainer save a preemption checkpoint, which is the
second writer this prevents. A checkpoint cut off mid-write never looks complete (writes are
atomic), so a resumed run loads the newest intact one.

A process that inherited the variable but is not the launcher's child (a worker's own Python
subprocess) is left alone while the launcher lives: its parent is the guarded worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

#: The environment variable through which `fittrain launch` gives its workers its process id.
LAUNCHER_PID_ENV = "FITTRAIN_LAUNCHER_PID"
#: How often the fallback watchdog (no prctl) checks that the launcher still lives, in seconds.
WATCH_INTERVAL = 1.0

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_WATCHDOG_NAME = "fittrain-launcher-watchdog"


def launcher_environment() -> dict[str, str]:
    """The variable that `fittrain launch` exports to its workers: its own process id."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def guard_worker() -> None:
    """Makes this process die with the `fittrain launch` that started it; outside one, does nothing.

    Called when fittrain builds a process's state, before it joins the process group, so an
    orphan never joins one. Safe to call more than once.

    Raises:
        ValueError: when FITTRAIN_LAUNCHER_PID is set but is not a process id.
    """
    launcher = _launcher_pid()
    if launcher is None:
        return
    if os.getppid() != launcher:
        if not _exists(launcher):
            _die(launcher)  # the launcher is already gone
        return  # a descendant of a worker: the worker is guarded, and its children are its own
    if not _set_parent_death_signal():
        watch_parent(launcher)
    if os.getppid() != launcher:  # the launcher died before the kernel was asked to tell us
        _die(launcher)


def watch_parent(launcher: int, interval: float = WATCH_INTERVAL) -> threading.Thread:
    """Starts (once per process) a daemon thread that kills this process when `launcher` stops being its parent.

    The fallback where the kernel cannot signal a parent's death (no Linux `prctl`).

    Args:
        launcher: The parent process id to watch.
        interval: Seconds between checks.

    Returns:
        The watching thread.
    """
    for thread in threading.enumerate():
        if thread.name == _WATCHDOG_NAME:
            return thread

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(interval)
        _die(launcher)

    thread = threading.Thread(target=watch, name=_WATCHDOG_NAME, daemon=True)
    thread.start()
    return thread


def _launcher_pid() -> int | None:
    value = os.environ.get(LAUNCHER_PID_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"Environment variable {LAUNCHER_PID_ENV} must be the process id of the `fittrain launch` "
                         f"that started this process. Received: {LAUNCHER_PID_ENV}={value!r}. Unset it: "
                         "`fittrain launch` sets it for its workers.")
    return int(value)


def _set_parent_death_signal() -> bool:
    """Asks Linux to SIGKILL this process when its parent dies; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process now holds the number; ours cannot be told apart
    return True


def _die(launcher: int) -> None:
    print(f"fittrain: the `fittrain launch` process (pid {launcher}) that started this worker is gone; "
          "stopping, as the job is over.", file=sys.stderr, flush=True)
    kill = getattr(signal, "SIGKILL", None)
    if kill is None:  # Windows
        os._exit(1)
    os.kill(os.getpid(), kill)
