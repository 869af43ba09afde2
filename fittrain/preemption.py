"""Graceful preemption: on SIGTERM or SIGUSR1, finish the step, save a checkpoint, exit 75.

Cluster schedulers send SIGTERM (SLURM can send SIGUSR1) shortly before they kill a job. The
handler only sets a flag; the Trainer acts on it at an optimizer-step boundary, where a
checkpoint resumes exactly. Exit code 75 is sysexits' EX_TEMPFAIL: "try again", which is what a
requeued job does with `resume_from="latest"`.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Iterable

import torch

PREEMPTION_EXIT_CODE = 75
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


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

    Args:
        signals: Signal names or numbers to treat as "save and stop". Empty disables it.
        check_every: In multi-process runs, ranks agree on a stop every this many optimizer steps
            (one tiny all-reduce); one process checks every step for free.
    """

    def __init__(self, signals: Iterable[int | str] = DEFAULT_SIGNALS, check_every: int = 10) -> None:
        self.signals = _to_signals(signals)
        self.check_every = check_every
        self.requested = False
        self._exiting = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def __enter__(self) -> "PreemptionWatcher":
        self.requested = self._exiting = False
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
        flag = torch.tensor([1.0 if self.requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
