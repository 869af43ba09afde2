"""A clean exit for multi-process runs, also when a script never calls `end_training()`.

Why this exists: torch's gloo backend runs each collective on a worker thread of its own, and that
thread drops its references to the collective's tensors just after the collective completes.
Dropping a tensor that Python also knows takes the GIL. When the main thread has meanwhile reached
interpreter finalization (a script that ends right after a collective, on a busy machine), CPython
ends the worker thread as it asks for the GIL; the thread unwinds through a C++ destructor, and the
process dies with "terminate called without an active exception" (SIGABRT) after all its work is
done, so torchrun reports the run as failed. Plain torch scripts do the same now and then.

The cure is to destroy the process group before finalization: its destructor joins the worker
threads. fittrain registers `leave_process_group` with `atexit` when it creates the group (atexit
handlers run before finalization), and `Accelerator.end_training` does it at once.

Where the destructor runs matters as much. It waits for the worker threads, and a worker that is
dropping its last collective's tensors waits for the GIL (while holding the lock the destructor
needs). torch releases the GIL when the group's last *Python* reference goes, but not when the last
reference is a DDP `Reducer` collected by `gc`, nor torch's native registry: a destructor reached
that way deadlocks (seen: rank 0 of a finished 4-process job hung in `gc.collect()` here, forever).
So `leave_process_group` collects garbage (a Trainer's DDP model, typically) *before* destroying the
group, while the registry still holds it, and keeps Python references to every group across the
destroy, so that dropping them last runs the destructor without the GIL.

The destructor runs only when nothing holds the group any more. torch._dynamo, when it is first
imported while a group exists (DDP's constructor imports it), keeps references to that group out of
reach; so `state.ProcessState` imports it before it creates the group. A DDP model that the script
itself still holds at exit keeps its group alive too; that case remains.
"""

from __future__ import annotations

import gc
import sys

import torch.distributed as dist


def exiting_on_error() -> bool:
    """Whether the interpreter is exiting because of an unhandled exception.

    CPython records the exception (``sys.last_exc``, ``sys.last_value`` before 3.12) when it prints
    the traceback, before any atexit handler runs.
    """
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def leave_process_group() -> None:
    """Destroys every process group, and collects garbage so none lingers into finalization.

    Safe to call when no group exists. A group that something still references (a DDP model the
    script keeps) lives on, but with its collectives finished and released by now. The order of
    the steps is what keeps the group's destructor off the GIL (see the module docstring).
    """
    gc.collect()  # a garbage DDP Reducer must drop its group while the registry still holds it
    if dist.is_available() and dist.is_initialized():
        groups = _every_group()
        dist.destroy_process_group()
        del groups  # the last references, if nothing else holds them: dropped where torch lets the GIL go
    gc.collect()


def _every_group() -> list[dist.ProcessGroup]:
    """Every process group torch has registered, the default one included."""
    # torch keeps the registry private; without it (another torch), the default group is the one
    # fittrain itself creates, and the others are released however torch releases them.
    world = getattr(dist.distributed_c10d, "_world", None)
    registered = list(getattr(world, "pg_map", {}))
    return registered or [dist.group.WORLD]
