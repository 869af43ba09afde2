"""Hang detection: a rank that stops answering inside the training loop ends the job within a bound.

Without it, a peer that is stopped (SIGSTOP, a frozen machine) or deadlocked leaves every other
rank waiting in a collective for the process group's timeout: 30 minutes by default. torchrun's
agent notices a rank that *dies* within seconds, but not one that hangs.

How it works, on every rank of a multi-process fit:

- The loop marks each training step's window (`begin` and `end`: forward, backward, the optimizer
  step and their collectives; not validation, saves or callbacks' end-of-batch work), two
  attribute stores a step.
- A daemon thread publishes a heartbeat to the process group's store every `period` seconds: a
  counter, the steps done, and whether the rank is inside a step window.
- When this rank's current step has run longer than the bound, and the thread has watched the
  others' heartbeats for `3 * period` seconds, it decides (`find_hang`):
  - a peer whose heartbeat has not changed for `3 * period` seconds **stopped answering** (its
    whole process is frozen: no thread of it runs);
  - a peer outside a step window is **busy** with a one-off operation (a save, validation, a first
    compile, `main_process_first` preprocessing): keep waiting, however long it takes;
  - every peer inside a step, beyond the bound: a **deadlock** (for example ranks in different
    collectives).
- On a stopped peer or a deadlock it prints which ranks, with this rank's stack, records the
  message in torchrun's error file (so torchrun's summary shows it), kills a stopped peer that runs
  on this machine, and exits with code 1. torchrun then ends the job, or restarts it where
  `--max_restarts` allows (`resume_from="auto"` continues from the newest checkpoint).

The bound ("auto") is max(60 s, 20 x the median step time), measured after the first
`ARM_AFTER_STEPS` steps (a first compile is never judged): a tiny model's job ends 60 to 65
seconds after a rank stops, a slow model's bound grows with its steps.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, Sequence

from fittrain.common.reprs import short_repr

#: "auto": the bound is max(AUTO_FLOOR seconds, AUTO_FACTOR x the median step).
AUTO = "auto"
AUTO_FLOOR = 60.0
AUTO_FACTOR = 20.0
#: Steps a fit runs before the bound applies: a first step (compiling, warming caches) is not typical.
ARM_AFTER_STEPS = 3
#: Heartbeat period at most (seconds); shorter bounds beat 4 times per bound.
MAX_PERIOD = 5.0
#: A heartbeat unchanged for this many periods is a stopped process.
STALE_PERIODS = 3
HANG_EXIT_CODE = 1

IN_STEP, OUTSIDE, LEFT = "step", "outside", "left"


def check_hang_timeout(value: Any) -> float | str | None:
    """`Trainer(hang_timeout=...)` checked: "auto", a positive number of seconds, or None (off).

    Raises:
        ValueError: for anything else, naming the value and the choices.
    """
    if value is None or value == AUTO:
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(
        f"`hang_timeout` must be 'auto', a positive number of seconds, or None. Received: hang_timeout="
        f"{short_repr(value)} ({type(value).__name__}). 'auto' (the default) ends a job whose training step "
        f"waits longer than max({AUTO_FLOOR:.0f} s, {AUTO_FACTOR:.0f} x the median step) for a rank that stopped "
        "answering; a number fixes that bound in seconds; None waits for the collective timeout (30 minutes).")


@dataclasses.dataclass(frozen=True)
class Peer:
    """What this rank knows of another from its heartbeats.

    Attributes:
        rank: Its global rank.
        silent_for: Seconds (this rank's clock) since its heartbeat last changed; inf if never read.
        steps: Training steps it finished in this fit.
        phase: IN_STEP, OUTSIDE (a save, validation, data loading) or LEFT (its fit ended).
        pid: Its process id.
        host: Its machine's name.
    """

    rank: int
    silent_for: float
    steps: int = -1
    phase: str = "unknown"
    pid: int = 0
    host: str = ""


def find_hang(rank: int, steps: int, overdue: float, bound: float, peers: Sequence[Peer],
              stale_after: float) -> str | None:
    """The verdict of a rank whose step has run `overdue` seconds (> `bound`): a message when the
    job hangs, None when a peer is still busy outside its training step.

    Args:
        rank: This rank.
        steps: The steps it finished (it is in step `steps`).
        overdue: How long its current step has run.
        bound: The bound that step exceeded, for the message.
        peers: The other ranks.
        stale_after: A peer silent this long is stopped.
    """
    stopped = [p for p in peers if p.silent_for >= stale_after and p.phase != LEFT]
    if not stopped and any(p.phase not in (IN_STEP, LEFT) for p in peers):
        return None  # a peer saves, validates or loads data: one-off work keeps the long timeout
    head = (f"fittrain: rank {rank} waited {overdue:.0f} s in training step {steps}, longer than the hang bound "
            f"of {bound:.0f} s (Trainer(hang_timeout=...)).")
    if stopped:
        names = ", ".join(f"rank {p.rank}" + (f" (pid {p.pid} on {p.host})" if p.pid else "") for p in stopped)
        return (f"{head} {names} stopped answering: no heartbeat for {min(p.silent_for for p in stopped):.0f} s or "
                "more. Its process is stopped (SIGSTOP, a debugger), frozen with its machine, or cut off from the "
                "network. The job ends now; under `fittrain launch --max_restarts N` it restarts, and "
                "resume_from='auto' continues from the newest checkpoint.")
    where = ", ".join(f"rank {p.rank} " + (f"in step {p.steps}" if p.phase == IN_STEP else
                                            f"ended its fit after {p.steps} steps") for p in peers)
    return (f"{head} No rank is stopped and none is saving, validating or loading data ({where}): a deadlock, "
            "such as a collective called on some ranks only, ranks running different numbers of steps, or a "
            "lock never released. The job ends now; each rank prints the stacks of its threads after this message.")


class StepWindow:
    """What the loop tells a watchdog; for one process, nothing: no peer can hang."""

    #: Whether anything watches: the loop skips `begin`/`end` per step when nothing does.
    watching = False

    def begin(self) -> None:
        """A training step starts."""

    def end(self) -> None:
        """The training step ended."""

    def close(self) -> None:
        """The fit ended (or failed): stop watching."""


class HangWatchdog(StepWindow):
    """Watches one rank's training steps and its peers' heartbeats (the module docstring says how).

    Args:
        store: A torch.distributed Store every rank of the group reaches (its own client: calls
            from the watchdog's thread must not wait behind the process group's).
        rank: This process's global rank.
        world_size: The number of processes.
        timeout: AUTO or a fixed bound in seconds.
        on_hang: Called with the message and the stopped peers when the job hangs; default
            `end_job` (which exits the process).
    """

    watching = True

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float | str = AUTO,
                 on_hang: Callable[[str, Sequence[Peer]], None] | None = None) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.on_hang = on_hang or end_job
        self.period = heartbeat_period(timeout)
        self.began: float | None = None  # when the current step started (time.monotonic), None outside one
        self.steps = 0
        self._step_times: deque[float] = deque(maxlen=64)
        self._identity = f"{os.getpid()} {socket.gethostname()}"
        self._stop = threading.Event()
        self._publish(OUTSIDE)  # at once: a rank that stops within the first period is still named
        self._thread = threading.Thread(target=self._watch, name="fittrain-hang-watchdog", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- the loop's calls (per step)
    def begin(self) -> None:
        self.began = time.monotonic()

    def end(self) -> None:
        self.began = None
        self.steps += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 5)
        self._publish(LEFT)

    # ----------------------------------------------------------------- the thread
    def bound(self) -> float | None:
        """The current bound in seconds; None while the fit has run too few steps to judge."""
        return None if self.steps < ARM_AFTER_STEPS else hang_bound(self.timeout, self._step_times)

    def _watch(self) -> None:
        seq, last = 0, (0, time.monotonic())
        seen: dict[int, tuple[str, float]] = {}  # peer -> (its last heartbeat, when it changed)
        stale_after = STALE_PERIODS * self.period
        watching = 0.0  # when this rank began reading its peers' heartbeats in the current wait
        while not self._stop.wait(self.period):
            now, began, steps = time.monotonic(), self.began, self.steps
            if steps > last[0]:  # the step time: elapsed over steps done since the last beat
                self._step_times.append((now - last[1]) / (steps - last[0]))
                last = (steps, now)
            seq += 1
            self._publish(IN_STEP if began is not None else OUTSIDE, seq)
            if began is None or now - began < self.period:
                seen.clear()  # peers are read only while this rank waits in a step
                continue
            watching = watching if seen else now
            peers = self._read_peers(seen, now)
            bound = self.bound()
            # A verdict needs the peers watched long enough to tell a stopped one (silent) from one
            # alive in its step (beating): a thread starved until past the bound must not guess.
            if bound is None or now - began < bound or self.began != began or now - watching < stale_after:
                continue
            message = find_hang(self.rank, steps, now - began, bound, peers, stale_after)
            if message is not None:
                self.on_hang(message, [p for p in peers if p.silent_for >= stale_after and p.phase != LEFT])
                return

    def _publish(self, phase: str, seq: int = -1) -> None:
        try:
            self.store.set(f"rank{self.rank}", f"{seq} {self.steps} {phase} {self._identity}")
        except Exception:  # an unreachable store: the peers' heartbeats tell the rest
            pass

    def _read_peers(self, seen: dict[int, tuple[str, float]], now: float) -> list[Peer]:
        peers = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            try:  # check first: get would wait for a key that a peer never published
                value = self.store.get(f"rank{r}").decode() if self.store.check([f"rank{r}"]) else None
            except Exception:  # a store that does not answer: the peer counts as silent
                value = None
            before = seen.get(r)
            if value is not None and (before is None or before[0] != value):
                seen[r] = before = (value, now)
            elif before is None:
                seen[r] = before = ("", now)
            fields = before[0].split(" ")
            if len(fields) == 5:
                peers.append(Peer(r, now - before[1], int(fields[1]), fields[2], int(fields[3]), fields[4]))
            else:
                peers.append(Peer(r, now - before[1]))
        return peers


def hang_bound(timeout: float | str, step_times: Sequence[float]) -> float | None:
    """A fixed `timeout`, or for AUTO max(AUTO_FLOOR, AUTO_FACTOR x the median of `step_times`)
    (None before any step time is known)."""
    if timeout != AUTO:
        return float(timeout)
    return max(AUTO_FLOOR, AUTO_FACTOR * statistics.median(step_times)) if step_times else None


def heartbeat_period(timeout: float | str) -> float:
    """Seconds between heartbeats: MAX_PERIOD, or a quarter of a shorter fixed bound."""
    return MAX_PERIOD if timeout == AUTO else min(MAX_PERIOD, float(timeout) / 4)


def watch_steps(timeout: float | str | None, rank: int, world_size: int) -> StepWindow:
    """The step window a fit's loop marks: a `HangWatchdog` for several processes (unless
    `timeout` is None), else one that does nothing."""
    if world_size == 1 or timeout is None:
        return StepWindow()
    from torch.distributed import PrefixStore, distributed_c10d

    # A client of its own, whose calls give up within a period or two: a store hosted by a stopped
    # rank (a job started without torchrun) must not hang the watchdog too. torch has no public
    # getter for the group's store.
    try:
        store = distributed_c10d._get_default_store().clone()
        store.set_timeout(datetime.timedelta(seconds=max(1.0, heartbeat_period(timeout))))
    except Exception as err:  # a private API: if torch changes it, train on, without the watchdog
        warnings.warn(f"fittrain: hang detection is off for this fit: the process group's store could not be "
                      f"reached ({type(err).__name__}: {err}). A rank that hangs will be waited for until the "
                      "collective timeout. Pass Trainer(hang_timeout=None) to silence this.", stacklevel=3)
        return StepWindow()
    prefix = f"/fittrain/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return HangWatchdog(PrefixStore(prefix, store), rank, world_size, timeout)


def end_job(message: str, stopped: Sequence[Peer]) -> None:
    """Ends this process for a hang: the message and this rank's stacks on stderr, the message in
    torchrun's error file, a stopped peer on this machine killed (torchrun would wait 30 s more for
    it to answer SIGTERM), then exit code HANG_EXIT_CODE."""
    print(message, file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's failure summary prints this message as the rank's error
        try:
            with open(error_file, "w") as file:
                json.dump({"message": message, "timestamp": int(time.time())}, file)
        except OSError:
            pass
    host = socket.gethostname()
    for peer in stopped:
        if peer.pid and peer.host == host and _is_stopped(peer.pid):
            try:
                os.kill(peer.pid, signal.SIGKILL)
            except OSError:
                pass
    os._exit(HANG_EXIT_CODE)


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc): only such a peer is killed, never a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
