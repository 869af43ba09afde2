"""Multi-process jobs whose ranks are forked from a process that has already imported torch.

A `torchrun` job of 2 ranks starts three interpreters that each import torch (seconds of CPU
apiece on a small machine) before a single collective runs; across the suite that import is most
of its time. Here a `multiprocessing` forkserver, started once per test session with torch and
fittrain preloaded (and nothing run: no torch op, so no thread exists to be lost by `fork`), forks
each rank. The rank then becomes what torchrun would have started:

- torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*), on top
  of the caller's, and one torch thread per `OMP_NUM_THREADS`;
- the script runs with `runpy` as `__main__`, with `sys.argv`, `sys.path[0]` and the cwd of a
  fresh `python script.py`;
- at the end, like an interpreter, it joins non-daemon threads and runs the atexit handlers
  (fittrain leaves its process group there), and exits with the script's exit code.

The ranks join a real gloo process group: like torchrun's agent, the caller hosts the job's
TCPStore (on a port the OS picks while binding it, so no port can be lost to a race) and every
rank joins it as a client (TORCHELASTIC_USE_AGENT_STORE). Nothing in torch.distributed is mocked.

Jobs about launching itself (torchrun, `fittrain launch`, signals, preemption) keep real launchers.
tests/support/jobs.py runs both kinds; each forked job raises the audit event `AUDIT_EVENT`, which
the suite's guard (tests/conftest.py) counts as a started process, as it does a new interpreter.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import signal
import sys
import tempfile
import time
import uuid

#: Imported once by the forkserver, so that no rank pays for them. Only imports: running any
#: torch op there would start thread pools that a forked rank could not use.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.nn.parallel", "safetensors.torch", "fittrain", "fittrain.callbacks", "support.rank_main"]


def _context() -> multiprocessing.context.BaseContext:
    """The session's forkserver context, with torch and fittrain preloaded on first use."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # The forkserver inherits this environment when it starts: give it a rank's thread setting, so
    # that whatever torch reads at import matches a torchrun worker's, and the mark of a process
    # that outlives the test that started it (tests/conftest.py's guard).
    with _temporary_env(OMP_NUM_THREADS="1", FITTRAIN_TEST_SESSION_PROCESS="1"):
        multiprocessing.forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _temporary_env(**values: str):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """`base` plus what torchrun's local agent sets for one worker of a single-node job."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
               LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=uuid.uuid4().hex[:8],
               TORCHELASTIC_USE_AGENT_STORE="True",
               TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
    return env


#: The audit event raised (`sys.audit`) for each job of forked ranks, with the script and the process count.
AUDIT_EVENT = "fittrain.tests.ranks"
#: Appended to a rank's log path: the file where the rank writes its exit code as it ends.
EXIT_SUFFIX = ".exit"


def _alive(pid: int | None) -> bool:
    """Whether process `pid` still exists (a rank is the forkserver's child, which reaps it)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    """Kills a rank with everything it started (each rank leads a session of its own)."""
    if proc.pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)


class Job:
    """`nproc` ranks of a script, forked and running; `wait` for them, `close` when done.

    The caller hosts the job's TCPStore, as torchrun's agent does, until `close`.
    """

    def __init__(self, script: pathlib.Path, args: list[str], nproc: int, env: dict[str, str],
                 torchrun: bool = True, cwd: str | None = None) -> None:
        """With `torchrun=False`, one process with `env` as it is: a fresh `python script args`.
        The ranks run in `cwd`, by default this process's working directory."""
        if not torchrun and nproc != 1:
            raise ValueError(f"A job without torchrun's environment has one process. Received: nproc={nproc}. "
                             "Pass nproc=1, or torchrun=True.")
        sys.audit(AUDIT_EVENT, str(script), nproc)
        # Imported here: the test process needs torch.distributed only for the jobs it hosts a store for.
        from torch.distributed import TCPStore

        from support.rank_main import main

        ctx = _context()
        self._logs = tempfile.TemporaryDirectory(prefix="fittrain-ranks-")
        self._store = TCPStore("127.0.0.1", 0, world_size=nproc, is_master=True, wait_for_workers=False) \
            if torchrun else None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.log_paths = [os.path.join(self._logs.name, f"rank{rank}.log") for rank in range(nproc)]
        self.codes: list[int | None] = [None] * nproc
        try:
            for rank in range(nproc):
                self.procs.append(ctx.Process(target=main, name=f"rank{rank}", args=(
                    str(script), [str(a) for a in args],
                    rank_env(env, rank, nproc, self._store.port) if self._store else dict(env), cwd or os.getcwd(),
                    self.log_paths[rank])))
                self.procs[-1].start()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        """Rank 0's process id."""
        return self.procs[0].pid

    def _exit_code(self, rank: int) -> int | None:
        """Rank `rank`'s exit code, None while it runs.

        The forkserver reports a rank's exit on its sentinel; in rare full-suite runs that report
        never came although the rank had ended (the wait then lasted to the deadline), so a rank
        also leaves its code in a file as its last act (rank_main.main), read once its process is gone.
        """
        proc = self.procs[rank]
        if proc.exitcode is not None:
            return proc.exitcode
        written = pathlib.Path(self.log_paths[rank] + EXIT_SUFFIX)
        if not written.is_file() or _alive(proc.pid):
            return None
        return int(written.read_text() or "1")

    def _codes(self) -> list[int | None]:
        return [self._exit_code(rank) for rank in range(len(self.procs))]

    def running(self) -> bool:
        return any(code is None for code in self._codes())

    def wait(self, timeout: float) -> bool:
        """Waits until every rank ended, or one failed (torchrun then stops the others, and so does
        `close`), or `timeout` seconds passed. Returns whether the job ended in time."""
        deadline = time.monotonic() + timeout
        while self.running() and not self.failed():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # In slices of a second, so that a rank whose sentinel stays silent is still seen to end.
            multiprocessing.connection.wait([p.sentinel for p in self.procs if p.exitcode is None],
                                            timeout=min(left, 1.0))
        self.codes = self._codes()  # before the survivors of a failure are killed
        return True

    def failed(self) -> bool:
        return any(code not in (None, 0) for code in self._codes())

    @property
    def returncode(self) -> int | None:
        """The first failed rank's exit code, 0 when all succeeded, None while it runs (or was killed)."""
        failed = next((code for code in self.codes if code not in (None, 0)), None)
        if failed is not None:
            return failed
        return 0 if all(code == 0 for code in self.codes) else None

    def output(self) -> str:
        """What the ranks printed, rank 0's first."""
        return "".join(pathlib.Path(path).read_text(errors="replace") for path in self.log_paths
                       if os.path.exists(path))

    def close(self) -> None:
        """Kills the ranks still running (with their children), stops the store, removes the logs."""
        for rank, proc in enumerate(self.procs):
            if self._exit_code(rank) is None:
                _kill(proc)
                proc.join(timeout=30)  # a SIGKILLed process ends at once; the bound guards the unexpected
            elif proc.exitcode is None:
                # Ended, by its exit file, without a report from the forkserver: forget it, or
                # multiprocessing would join it at interpreter exit and wait for that report forever.
                multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]
        self._store = None
        self._logs.cleanup()

