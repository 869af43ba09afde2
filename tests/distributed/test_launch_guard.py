"""fittrain/distributed/launch_guard.py on its own: real processes, no launcher.

The end-to-end case (SIGKILL to a real `fittrain launch` leaves no worker) is in
tests/launch/test_launch_signals.py; these cover the paths it does not reach: the watchdog
used where Linux's prctl is missing, a launcher already gone, a process that is not the
launcher's child, and a malformed variable.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fittrain.distributed.launch_guard import LAUNCHER_PID_ENV, guard_worker

_GUARD = "from fittrain.distributed.launch_guard import guard_worker; guard_worker()"

#: Generous bounds for a busy machine; each child imports torch.
START_TIMEOUT = 120.0
GONE_TIMEOUT = 30.0

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to see processes")]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    env.update(extra)
    return env


def _is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_for(path: pathlib.Path, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while not (path.exists() and path.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{path.name} never appeared (exit {proc.poll()}): {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return path.read_text()


def test_the_watchdog_stops_a_worker_whose_launcher_was_killed(tmp_path: pathlib.Path) -> None:
    """The fallback without prctl: a thread notices the parent is gone (the process is re-parented)."""
    ready = tmp_path / "child.pid"
    child = f"""
        import os, pathlib, time
        from fittrain.distributed.launch_guard import watch_parent
        watch_parent(os.getppid(), interval=0.05)
        pathlib.Path({str(ready)!r}).write_text(str(os.getpid()))
        time.sleep(300)
    """
    launcher = subprocess.Popen(_python(f"import subprocess, sys, time\nsubprocess.Popen({_python(child)!r})\n"
                                        "time.sleep(300)"), env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    worker = 0
    try:
        worker = int(_wait_for(ready, launcher))
        launcher.kill()  # SIGKILL: the launcher runs no code of its own
        launcher.wait(timeout=30)
        deadline = time.monotonic() + GONE_TIMEOUT
        while _is_running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _is_running(worker), "the watched worker outlived its launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        if worker and _is_running(worker):
            os.kill(worker, signal.SIGKILL)
        launcher.communicate()


def test_a_worker_whose_launcher_is_already_gone_stops_at_once() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: the launcher died before the worker got going
    worker = subprocess.run(_python(f"{_GUARD}; print('ran on')"),
                            env=_env(**{LAUNCHER_PID_ENV: str(gone.pid)}), capture_output=True, text=True,
                            timeout=START_TIMEOUT)
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    assert "ran on" not in worker.stdout
    assert f"the `fittrain launch` process (pid {gone.pid}) that started this worker is gone" in worker.stderr


def test_a_process_that_is_not_the_launchers_child_is_left_alone() -> None:
    """A worker's own subprocess inherits the variable; while the launcher lives, it runs as usual."""
    with subprocess.Popen(["sleep", "300"]) as sibling:  # alive, but not the child's parent
        try:
            child = subprocess.run(_python(f"{_GUARD}; print('ran on')"),
                                   env=_env(**{LAUNCHER_PID_ENV: str(sibling.pid)}),
                                   capture_output=True, text=True, timeout=START_TIMEOUT)
        finally:
            sibling.kill()
    assert child.returncode == 0 and "ran on" in child.stdout, child.stderr[-3000:]


@pytest.mark.parametrize("value", ["abc", "0", "-5", "12.5"])
def test_a_malformed_launcher_pid_is_named(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAUNCHER_PID_ENV, value)
    with pytest.raises(ValueError, match=rf"{LAUNCHER_PID_ENV} must be the process id .* Received: "
                                         rf"{LAUNCHER_PID_ENV}='{value}'\. Unset it"):
        guard_worker()


def test_outside_fittrain_launch_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    guard_worker()  # this test process goes on
