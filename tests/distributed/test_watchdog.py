"""The hang watchdog's rules (fittrain/distributed/watchdog.py), in one process: the bound, the
verdict from peers' heartbeats, and the watchdog thread over a real store. The end-to-end cases
(a rank stopped with SIGSTOP, a slow save) run real workers in tests/launch/test_launch_hangs.py."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch.distributed as dist

from fittrain import Trainer
from fittrain.distributed.watchdog import (
    AUTO,
    IN_STEP,
    LEFT,
    OUTSIDE,
    HangWatchdog,
    Peer,
    StepWindow,
    check_hang_timeout,
    find_hang,
    hang_bound,
    watch_steps,
)

DEADLINE = 30.0  # seconds a test waits for the watchdog's verdict at most


@pytest.mark.parametrize("value", [AUTO, None, 5, 0.5])
def test_hang_timeout_accepts_auto_seconds_or_none(value: object) -> None:
    assert check_hang_timeout(value) == (value if value in (AUTO, None) else float(value))


@pytest.mark.parametrize("value", [0, -3, math.nan, math.inf, True, "fast", "60"])
def test_a_bad_hang_timeout_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"`hang_timeout` must be 'auto', a positive number of seconds, or None\. "
                                         rf"Received: hang_timeout={value!r}"):
        Trainer(hang_timeout=value)


def test_the_auto_bound_is_a_minute_or_twenty_median_steps() -> None:
    assert hang_bound(AUTO, []) is None  # no step timed yet
    assert hang_bound(AUTO, [0.004, 0.005, 0.2]) == 60.0  # a tiny model: the floor
    assert hang_bound(AUTO, [4.0, 5.0, 90.0]) == 100.0  # 20 x the median, not the mean
    assert hang_bound(7.5, [100.0]) == 7.5  # a fixed bound is used as given


def _peer(rank: int, phase: str, silent_for: float = 0.0, steps: int = 9) -> Peer:
    return Peer(rank, silent_for, steps, phase, 1000 + rank, "node-a")


def test_a_silent_peer_is_named_as_stopped() -> None:
    message = find_hang(0, 9, 70.0, 60.0, [_peer(1, IN_STEP), _peer(2, IN_STEP, silent_for=16)], stale_after=15)
    assert message is not None
    assert "rank 0 waited 70 s in training step 9, longer than the hang bound of 60 s" in message
    assert "rank 2 (pid 1002 on node-a) stopped answering" in message and "rank 1 " not in message


def test_a_peer_busy_outside_its_step_is_waited_for_however_long() -> None:
    assert find_hang(0, 9, 3600.0, 60.0, [_peer(1, OUTSIDE), _peer(2, IN_STEP)], stale_after=15) is None


def test_every_peer_inside_a_step_or_gone_is_a_deadlock() -> None:
    message = find_hang(0, 9, 70.0, 60.0, [_peer(1, IN_STEP, steps=8), _peer(2, LEFT, silent_for=99, steps=12)],
                        stale_after=15)
    assert message is not None and "a deadlock" in message
    assert "rank 1 in step 8, rank 2 ended its fit after 12 steps" in message


class _Verdicts:
    """Collects what the watchdog reports instead of ending the process."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.stopped: list[Peer] = []
        self.event = threading.Event()

    def __call__(self, message: str, stopped: list[Peer]) -> None:
        self.messages.append(message)
        self.stopped.extend(stopped)
        self.event.set()


def _in_long_step(watchdog: HangWatchdog) -> None:
    for _ in range(3):  # the steps before the bound applies
        watchdog.begin()
        watchdog.end()
    watchdog.begin()


def test_the_watchdog_names_a_peer_whose_heartbeat_froze() -> None:
    store, verdicts = dist.HashStore(), _Verdicts()
    store.set("rank1", "7 3 step 4242 node-b")  # rank 1's last heartbeat: it never beats again
    watchdog = HangWatchdog(store, 0, 2, timeout=0.4, on_hang=verdicts)
    try:
        _in_long_step(watchdog)
        assert verdicts.event.wait(DEADLINE), "no verdict"
    finally:
        watchdog.close()
    assert "rank 1 (pid 4242 on node-b) stopped answering" in verdicts.messages[0]
    assert [p.rank for p in verdicts.stopped] == [1]
    assert store.get("rank0").decode().split(" ")[2] == LEFT  # what its peers read once it closed


def test_a_watchdog_first_reading_its_peers_past_the_bound_still_tells_stopped_from_deadlocked() -> None:
    """A thread starved until long after the bound (a busy machine) reads its peers for the first
    time then: it must watch them for the stale period before a verdict, not call a peer whose
    heartbeat it has not had the time to see change "alive in a deadlock"."""
    store, verdicts = dist.HashStore(), _Verdicts()
    store.set("rank1", "7 3 step 4242 node-b")  # frozen
    watchdog = HangWatchdog(store, 0, 2, timeout=0.4, on_hang=verdicts)
    try:
        _in_long_step(watchdog)
        watchdog.began = time.monotonic() - 30.0  # as if this step had waited 30 s unobserved
        assert verdicts.event.wait(DEADLINE), "no verdict"
    finally:
        watchdog.close()
    assert "rank 1 (pid 4242 on node-b) stopped answering" in verdicts.messages[0], verdicts.messages[0]


def test_the_watchdog_waits_for_a_peer_that_beats_outside_its_step() -> None:
    store, verdicts, done = dist.HashStore(), _Verdicts(), threading.Event()

    def busy_peer() -> None:  # rank 1 saves (outside a step) and its heartbeat goes on
        beat = 0
        while not done.wait(0.05):
            beat += 1
            store.set("rank1", f"{beat} 3 {OUTSIDE} 4242 node-b")

    peer = threading.Thread(target=busy_peer, daemon=True)
    peer.start()
    watchdog = HangWatchdog(store, 0, 2, timeout=0.4, on_hang=verdicts)
    try:
        _in_long_step(watchdog)
        # Many bounds and stale periods pass: a busy machine only delays a verdict, which must not come.
        time.sleep(2.0)
        assert not verdicts.messages, verdicts.messages
        assert store.get("rank0").decode().split(" ")[2] == IN_STEP
    finally:
        done.set()
        watchdog.close()
        peer.join(timeout=DEADLINE)


def test_without_a_reachable_store_a_fit_trains_on_unwatched_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d

    def unreachable() -> None:
        raise RuntimeError("no default store")

    monkeypatch.setattr(distributed_c10d, "_get_default_store", unreachable)
    with pytest.warns(UserWarning, match=r"hang detection is off for this fit: the process group's store could not be "
                                         r"reached \(RuntimeError: no default store\)"):
        window = watch_steps(AUTO, 0, 2)
    assert type(window) is StepWindow


def test_one_process_has_nothing_to_watch() -> None:
    window = watch_steps(AUTO, 0, 1)
    assert type(window) is StepWindow
    assert type(watch_steps(None, 0, 4)) is StepWindow
