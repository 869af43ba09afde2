"""Graceful preemption: on SIGTERM or SIGUSR1, finish the step, save a checkpoint, exit 75.

Cluster schedulers send SIGTERM (SLURM can send SIGUSR1) shortly before they kill a job. The
handler only sets a flag; the Trainer acts on it at an optimizer-step boundary, where a
checkpoint resumes exactly. Exit code 75 is sysexits' EX_TEMPFAIL: "try again", which is what a
requeued job does with `resume_from="latest"`.

Under SLURM (SLURM_JOB_ID set), a stop caused by SIGUSR1 also requeues the job: once every rank
has saved, the main process runs `scontrol requeue $SLURM_JOB_ID`, as Lightning does on SLURM's
`--signal=USR1@90`. SIGTERM (scancel, or the time limit itself) never requeues. Set
FITTRAIN_SLURM_REQUEUE=0 to save and exit without requeueing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import threading
from types import FrameType
from typing import Any, Iterable, Iterator

import torch

from fittrain.distributed import slurm

PREEMPTION_EXIT_CODE = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
#: The signal SLURM is asked to send before the time limit (`#SBATCH --signal=USR1@90`): a stop
#: it causes requeues the job. SIGTERM is what scancel sends, and a cancelled job must stay so.
REQUEUE_SIGNAL = signal.SIGUSR1


# What torchrun handles itself by default (its --signals-to-handle), stopping the workers with it.
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

# The kernel delivers these without asking the process: no handler can catch them.
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def _to_signal(value: int | str) -> signal.Signals:
    try:
        if isinstance(value, bool):  # True would quietly mean signal 1 (SIGHUP)
            raise ValueError
        sig = signal.Signals[value] if isinstance(value, str) else signal.Signals(value)
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"`preemption_signals` must name signals such as 'SIGTERM' or 'SIGUSR1'. "
                         f"Received: {value!r}.") from None
    if sig.name in _UNCATCHABLE:
        raise ValueError(f"`preemption_signals` cannot include {sig.name}: the kernel kills or stops the process "
                         f"without running any handler, so there is no time to save. Received: {value!r}. Use "
                         "signals a scheduler sends before the kill, such as 'SIGTERM' or 'SIGUSR1'.")
    return sig


def _to_signals(signals: Any) -> list[signal.Signals]:
    """Checks `preemption_signals` as a whole: a list or tuple of signals, or () for none."""
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        hint = f"({signals!r},)" if isinstance(signals, str) else "('SIGTERM', 'SIGUSR1')"
        raise TypeError(f"`preemption_signals` must be a list or tuple of signal names or numbers, or () to "
                        f"disable preemption handling. Received: preemption_signals={signals!r} "
                        f"({type(signals).__name__}). Pass, for example, preemption_signals={hint}.")
    return [_to_signal(s) for s in signals]


def ignore_preemption_signals(worker_id: int = 0) -> None:
    """Makes a DataLoader worker ignore SIGTERM and SIGUSR1; pass it as `worker_init_fn`.

    Schedulers often signal a job's whole process group. PyTorch's DataLoader workers die on
    SIGTERM, and the main process then fails on its next batch before it can save. A worker
    that ignores the signal keeps serving batches until the Trainer has saved; it still exits
    with the main process (PyTorch's workers watch their parent).

    Args:
        worker_id: The worker's number, as DataLoader passes it (unused).

    Example:
        >>> DataLoader(dataset, num_workers=4, worker_init_fn=ignore_preemption_signals)
    """
    for name in DEFAULT_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


class PreemptionWatcher:
    """Records preemption signals while installed; restores the previous handlers on exit.

    After `mark_exiting` (a multi-process run that saved and is exiting with 75), leaving
    does not restore a signal's default disposition, which would kill the process: the signal
    stays ignored until the process ends. torchrun stops the other ranks with SIGTERM as soon as
    the first one exits, and a rank still saving or tearing down must exit 75 too, not -15.
    A handler that the program had installed itself is restored as usual.

    Under SLURM, a stop that SIGUSR1 caused on any rank also requeues the job (`requeue_if_asked`).

    Args:
        signals: Signal names or numbers to treat as "save and stop". Empty disables it.
        check_every: In multi-process runs, ranks agree on a stop every this many optimizer steps
            (one tiny all-reduce); one process checks every step for free.
    """

    def __init__(self, signals: Iterable[int | str] = DEFAULT_SIGNALS, check_every: int = 10) -> None:
        self.signals = _to_signals(signals)
        self.check_every = check_every
        self.requested = False
        self.requeue_requested = False  # REQUEUE_SIGNAL arrived here (or, after should_stop, on any rank)
        self._requeue_job: str | None = None
        self._exiting = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if signum == REQUEUE_SIGNAL:
            self.requeue_requested = True

    def __enter__(self) -> "PreemptionWatcher":
        self.requested = self.requeue_requested = self._exiting = False
        # Read now, so that a malformed FITTRAIN_SLURM_REQUEUE fails before training, not at the save.
        self._requeue_job = slurm.requeue_job_id()
        # Python delivers signals to the main thread only; elsewhere we cannot install handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            fatal = handler is None or handler == signal.SIG_DFL  # None: installed outside Python
            if fatal and self._exiting:
                handler = signal.SIG_IGN  # a second SIGTERM must not turn exit 75 into -15
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def mark_exiting(self, multi_process: bool) -> None:
        """Marks that the process now exits with `PREEMPTION_EXIT_CODE` after a preemption save.

        In a multi-process run, the preemption signals then stay ignored after leaving the
        watcher, until the process ends (see the class docstring). A single process restores
        its handlers as usual: no launcher signals it again.

        Args:
            multi_process: Whether other ranks (and a launcher watching them) exist.
        """
        self._exiting = multi_process

    def should_stop(self, accelerator: Any, global_step: int) -> bool:
        """Whether every rank should save and stop now (the same answer on all ranks)."""
        if not accelerator.use_distributed:
            return self.requested
        if global_step % self.check_every:
            return False
        # One all-reduce answers both questions: stop? and did SIGUSR1 reach any rank (requeue)?
        flags = torch.tensor([float(self.requested), float(self.requeue_requested)], device=accelerator.device)
        stop, requeue = (accelerator.reduce(flags, reduction="sum") > 0).tolist()
        self.requeue_requested = requeue
        return stop

    def requeue_if_asked(self, is_main_process: bool) -> bool:
        """Requeues the SLURM job after a preemption save, when SIGUSR1 asked for the stop.

        Call it on every rank once all of them have saved; only the main process acts. Nothing
        happens outside SLURM, after SIGTERM alone, or with FITTRAIN_SLURM_REQUEUE=0. A failing
        or missing `scontrol` is a warning (see `fittrain.distributed.slurm.requeue`): the checkpoint stays.

        Args:
            is_main_process: Whether this is global rank 0.

        Returns:
            Whether this process requeued the job.
        """
        if not (is_main_process and self.requeue_requested and self._requeue_job):
            return False
        return slurm.requeue(self._requeue_job)


def _child_pids() -> list[int]:
    """This process's direct children (for `fittrain launch`: torchrun's workers), from Linux's /proc."""
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in pathlib.Path(f"/proc/{os.getpid()}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


def launcher_signals() -> tuple[signal.Signals, ...]:
    """The signals `fittrain launch` passes on to its workers itself, rather than leaving to torchrun.

    SIGUSR1 always (torchrun would die of it). SIGTERM when torchrun can be told to leave it alone
    (its `--signals-to-handle`, torch 2.9 and later) and the workers can be found (Linux's /proc):
    torchrun's own SIGTERM handling stops the workers the same way, but then exits 143 and kills
    any worker still saving after its shutdown timeout (30 s). Forwarded, the workers save and exit
    75 in their own time, and the launcher exits with their 75.
    """
    # torch's elastic launcher: only the launching process needs it, and it is slow to import.
    from torch.distributed.launcher.api import LaunchConfig

    takes_sigterm = "signals_to_handle" in {field.name for field in dataclasses.fields(LaunchConfig)}
    if takes_sigterm and pathlib.Path(f"/proc/{os.getpid()}/task").is_dir():
        return (REQUEUE_SIGNAL, signal.SIGTERM)
    return (REQUEUE_SIGNAL,)


def torchrun_signal_args(forwarded: Iterable[signal.Signals]) -> list[str]:
    """torchrun's flag that leaves the `forwarded` signals to the launcher (none when it handles all)."""
    if signal.SIGTERM not in forwarded:
        return []
    return ["--signals-to-handle", ",".join(s for s in _TORCHRUN_SIGNALS if s != "SIGTERM")]


@contextlib.contextmanager
def forwarding_to_workers(signals: Iterable[signal.Signals] = (REQUEUE_SIGNAL,)) -> Iterator[None]:
    """While active, the `signals` sent to this launcher process are passed on to its worker processes.

    SLURM's `--signal=USR1@90` signals the tasks that srun started. With one `fittrain launch` per
    node, that task is the launcher: torchrun does not handle SIGUSR1, whose default action would
    kill the launcher and then the whole step, workers mid-save included. SIGTERM (srun, scancel,
    docker stop) is forwarded too when `launcher_signals` says torchrun leaves it to us. Forwarding
    lets the workers save (and requeue) and exit 75, which torchrun then reports as the job's exit
    code. A worker that also gets the signal directly (SLURM's cgroup process tracking signals
    every process of the step) only sets its flag twice. Workers are found in /proc (Linux);
    elsewhere the launcher only survives SIGUSR1.

    A SIGTERM that finds no worker (before torchrun started them), or a second SIGTERM, is handed
    to torchrun's own handling: it stops the workers (SIGKILL after its shutdown timeout) and
    the launcher exits 143, so a launcher whose script ignores SIGTERM still ends when asked twice.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    terminated = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal terminated
        workers = _child_pids()
        if signum == signal.SIGTERM and (terminated or not workers):
            # torch's elastic launcher: only the launching process needs it, and it is slow to import.
            from torch.distributed.elastic.multiprocessing import SignalException

            # What torchrun's own handler raises: its agent then stops the workers.
            raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)
        terminated = terminated or signum == signal.SIGTERM
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
