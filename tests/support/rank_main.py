"""The first code a forked rank runs (see ranks.py): it turns the fork into a fresh `python script.py`.

Preloaded by the forkserver, so the target of every rank is importable without a cost.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import runpy
import signal
import sys
import threading


def _redirect_output(log_path: str) -> None:
    """Sends fd 1 and 2 to the rank's log, line-buffered so a killed rank keeps what it printed."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.reconfigure(line_buffering=True)


def _become_fresh_process(script: str, argv: list[str], env: dict[str, str], cwd: str) -> None:
    """What a new interpreter would have: its environment, arguments, path, cwd, signals, seeds."""
    import torch  # preloaded by the forkserver: no cost, only a name here

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Forked ranks share the forkserver's seeds where fresh interpreters would each draw their own.
    random.seed()
    # The forkserver hands its own start method down; a fresh interpreter has the platform's
    # default (fork), which DataLoader workers and the scripts' own processes rely on.
    multiprocessing.set_start_method(None, force=True)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))


def _exit_code(exc: SystemExit) -> int:
    """The exit status the interpreter gives `sys.exit(code)`."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def main(script: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """Runs `script` as `__main__`, then ends like an interpreter: non-daemon threads joined,
    atexit handlers run, streams flushed, the script's exit status returned to the parent."""
    os.setsid()  # the rank leads a session, so that killing its group ends its children as well
    _redirect_output(log_path)
    _become_fresh_process(script, argv, env, cwd)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # fittrain's hook (if installed) sees it, as in a real process
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    # The parent also reads the code from here, should the forkserver's report of this exit not reach it.
    with open(log_path + ".exit", "w") as written:
        written.write(str(code))
    os._exit(code)
