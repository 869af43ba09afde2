"""Leaving the process group at the end of a run (fittrain.distributed.teardown), with real ranks."""

from __future__ import annotations

import pytest

from support.jobs import forked, run

pytestmark = pytest.mark.subprocess

#: A clean leave takes seconds; the deadlock it guards against never ends. The job's own deadline.
LEAVE_DEADLINE = 120.0


def test_leaving_with_a_collective_in_flight_and_a_garbage_ddp_model_does_not_deadlock() -> None:
    """Failed before: rank 0 hung in gc.collect(), destroying the group through DDP's Reducer with
    the GIL held while gloo's worker thread waited for the GIL (scripts/teardown_worker.py)."""
    job = run(forked(2, "teardown_worker.py"), timeout=LEAVE_DEADLINE).check()
    assert job.output.count("left: initialized=False") == 2, job.output[-4000:]
