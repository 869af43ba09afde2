"""Checkpoint folders written on a background thread while training goes on.

`Accelerator.save_state(async_save=True)` captures the state on the calling thread
(`snapshot.capture_state`, after any collective such as FSDP's gathering), copying tensors into
`StagingBuffers` on the CPU, then hands the writing to a `PendingCheckpoint` and returns.

Copying a large state costs as much as a memory copy of it (about 9% of a synchronous save), so
the tensors that change only in an optimizer step (parameters, the optimizers' per-parameter
state) are copied on the writing thread instead, while training runs the next forward and
backward passes; everything else (buffers that a forward pass updates, schedulers, RNG, loader
positions, registered objects) is copied at the call. The optimizers' step waits for that copy
(a step pre-hook: `BackgroundCheckpoints.guard`), and the copy checks every tensor's version
counter: a tensor changed in place meanwhile by anything but an optimizer step makes the save fail
with an error naming it, instead of writing a checkpoint that mixes two moments.
The folder is still written through `folder.atomic_checkpoint`, so it appears under its name
only when complete; until then, or after a crash, there is at most a hidden
`.checkpoint_N.tmp` folder that nothing loads.

`BackgroundCheckpoints` keeps at most one write in flight per Accelerator: the next save, a
load, `end_training` and `wait_for_checkpoint` wait for it and re-raise its error.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import threading
import warnings
import weakref
from copy import copy as shallow_copy
from copy import deepcopy
from typing import Any, Callable

import torch
import torch.distributed as dist

from fittrain.checkpoint.folder import no_barrier
from fittrain.distributed.process_state import ProcessState, collective_timeout
from fittrain.distributed.teardown import exiting_on_error


class PendingCheckpoint:
    """One checkpoint folder being written on a background thread.

    The thread starts at once. Whatever it raises is kept and re-raised by `wait`, in the
    thread that waits, with a note naming the folder.

    Args:
        folder: The checkpoint folder being written (named in the error note).
        write: Writes and commits the folder; it runs on the thread.
    """

    def __init__(self, folder: str | os.PathLike[str], write: Callable[[], None]) -> None:
        self.folder = pathlib.Path(folder)
        self.error: BaseException | None = None
        # A daemon thread: a main thread that dies (an unhandled error, a signal) must let the
        # process exit, not keep it alive on a write whose peers may be gone and whose barrier
        # would then wait out the collective timeout. Such a write leaves only the `.tmp` folder.
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                        name=f"fittrain-checkpoint-{self.folder.name}")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # re-raised by wait() in the thread that waits
            self.error = err

    @property
    def done(self) -> bool:
        """Whether the write has ended, successfully or not."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until the write has ended; re-raises its error, once.

        Raises:
            BaseException: whatever the write raised, with a note naming the folder.
        """
        self._thread.join()
        error, self.error = self.error, None
        if error is not None:
            error.add_note(f"Raised by the background checkpoint write to {self.folder}: that checkpoint "
                           "was not saved (at most its hidden .tmp folder is left). Earlier ones are intact.")
            raise error


# Values a copy may share with the state: nothing can change them in place.
_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class StagingBuffers:
    """CPU tensors that receive a snapshot's copies, reused by the next snapshot.

    The first write into freshly allocated memory costs a page fault per page, which for a large
    state is most of the copy's time (and pinned memory, which makes copies from a GPU fast, is
    slow to allocate). So the tensors of the previous snapshot, whose write is complete by the
    time the next one is taken, are reused in the order they were taken, when shape, dtype and
    strides agree. They stay allocated between saves: one CPU copy of the state.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._taken: list[torch.Tensor] = []
        # (buffer, live tensor, its version counter at the call): copies `fill` makes later.
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def reset(self) -> None:
        """Starts a snapshot. The caller guarantees that no write reads the buffers any more."""
        self._free, self._taken, self._deferred = self._taken, [], []

    @property
    def deferred(self) -> bool:
        """Whether the snapshot has copies left for `fill`."""
        return bool(self._deferred)

    def copy(self, obj: Any, later: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """A copy of a state that shares nothing mutable with it; its tensors live in the buffers.

        Containers keep their type (an OrderedDict stays one), so `torch.save` writes the same
        bytes as for the original. Copies from a GPU have landed when this returns.

        Args:
            obj: The state: a tree of containers, tensors and plain values.
            later: For a CPU tensor for which it is true, the buffer is taken now and filled by
                `fill`, on the writing thread.
        """
        devices: set[torch.device] = set()
        result = self._copy_tree(obj, devices, {}, set(), later)
        for device in devices:
            torch.cuda.synchronize(device)  # the writing thread reads the buffers next
        return result

    def fill(self) -> None:
        """Makes the copies `copy(..., later=...)` left, then checks that no live tensor changed since.

        Raises:
            RuntimeError: naming how many tensors changed in place after the call (their copies
                may hold either value, so the checkpoint must not be written).
        """
        deferred, self._deferred = self._deferred, []
        changed = 0
        for buffer, live, version in deferred:
            buffer.copy_(live)
            changed += live._version != version
        if changed:
            raise RuntimeError(
                f"{changed} parameter or optimizer-state tensor(s) were changed in place after "
                "save_state(async_save=True) returned and before the background copy read them, by something "
                "other than an optimizer step (which waits for the copy): the checkpoint would mix two moments, "
                "so it was not written. Change parameters in place only in optimizer.step(), call "
                "accelerator.wait_for_checkpoint() before such a change, or save with async_save=False.")

    def _copy_tree(self, obj: Any, devices: set[torch.device], memo: dict[int, Any], active: set[int],
                   later: Callable[[torch.Tensor], bool] | None) -> Any:
        """Copies `obj`; an object met again is copied once and shared again, as deepcopy does.

        Without the memo a small structure that shares its parts (`a = [a, a]`, 22 times over)
        would be copied once per path to each part, 2**22 times.

        Raises:
            ValueError: A container contains itself.
        """
        if obj is None or isinstance(obj, _IMMUTABLE):
            return obj
        key = id(obj)  # `obj` stays alive (the caller holds the whole state), so ids stay unique
        if key in memo:
            return memo[key]
        if key in active:
            raise ValueError(
                f"Cannot copy the state for an asynchronous save: a {type(obj).__name__} in it contains "
                "itself (a reference cycle). A checkpoint state must be a tree of dicts, lists, tuples, "
                "tensors and numbers; remove the cycle from the state_dict() of the scheduler or "
                "registered object that holds it, or save with async_save=False (torch.save keeps cycles)."
            )
        active.add(key)
        try:
            memo[key] = self._copy_node(obj, devices,
                                        lambda child: self._copy_tree(child, devices, memo, active, later), later)
        finally:
            active.discard(key)
        return memo[key]

    def _copy_node(self, obj: Any, devices: set[torch.device], copy_child: Callable[[Any], Any],
                   later: Callable[[torch.Tensor], bool] | None) -> Any:
        if type(obj).__name__ == "DTensor":  # a sharded state: copy this rank's shard, keep its layout
            from torch.distributed.tensor import DTensor  # only once one is met: a slow import otherwise unneeded

            local = self._copy_tensor(obj.to_local().detach(), devices, later)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), devices, later)
        if isinstance(obj, dict):
            items = [(key, copy_child(value)) for key, value in obj.items()]
            if type(obj) is dict:
                return dict(items)
            result = shallow_copy(obj)  # keeps a subclass's extras, such as a defaultdict's factory
            for key, value in items:  # the same keys, so the order stays
                result[key] = value
            return result
        if isinstance(obj, list):
            return [copy_child(value) for value in obj]
        if isinstance(obj, tuple):
            values = [copy_child(value) for value in obj]
            return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
        return deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor, devices: set[torch.device],
                     later: Callable[[torch.Tensor], bool] | None) -> torch.Tensor:
        index = len(self._taken)
        buffer = self._free[index] if index < len(self._free) else None
        if buffer is None or (buffer.shape, buffer.dtype, buffer.stride()) != (
                tensor.shape, tensor.dtype, tensor.stride()):
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        self._taken.append(buffer)
        if later is not None and not tensor.is_cuda and later(tensor):
            # detach() shares the live tensor's version counter: fill sees any in-place change.
            self._deferred.append((buffer, tensor, tensor._version))
            return buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            devices.add(tensor.device)
        return buffer


class BackgroundCheckpoints:
    """An Accelerator's background checkpoint writes: at most one in flight at a time.

    Under several processes the writing threads synchronise on a gloo group of their own, made
    at the first background save. Collectives on the default group, which the main thread keeps
    running (gradient all-reduces, the next save's gathering), are not safe to interleave with
    collectives issued from another thread on the same group.

    Args:
        state: The processes of the run.
    """

    def __init__(self, state: ProcessState) -> None:
        self._state = state
        self._group: Any = None
        self._pending: PendingCheckpoint | None = None
        self._buffers = StagingBuffers()
        self._staged = threading.Event()  # clear while a snapshot's deferred copies are being made
        self._staged.set()
        self._guarded: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers whose step waits for them
        self._hooks: list[Any] = []
        # The write thread is a daemon, so a script that ends without waiting would lose the
        # checkpoint. Registered after the default group's handler (this object is made at the first
        # async save), so it runs before that one: the write lands, then this group goes.
        atexit.register(_close_at_exit, weakref.ref(self))

    def stager(self) -> Callable[..., Any]:
        """Waits for the write in flight, then returns the copy function for the next snapshot.

        Returns:
            `StagingBuffers.copy` (its `later` argument defers copies to the writing thread), for
            `snapshot.capture_state`.
        """
        self.wait()  # its buffers are reused now
        self._buffers.reset()
        return self._buffers.copy

    def guard(self, optimizers: Any) -> None:
        """Makes each optimizer's step wait until the deferred copies of a snapshot are made: a step
        pre-hook on the optimizer itself, so that every step waits, through fittrain or not. Once per
        optimizer; an event already set costs the hook a few hundred nanoseconds a step."""
        for optimizer in optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)
            if inner not in self._guarded:
                self._guarded.add(inner)
                self._hooks.append(inner.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._staged.wait()

    def release_buffers(self) -> None:
        """Frees the CPU copy kept for reuse (call when no write is in flight); the next save
        allocates anew."""
        self._buffers = StagingBuffers()

    def start(self, folder: str | os.PathLike[str], write: Callable[[Callable[[], None], Any], None]) -> None:
        """Waits for the previous write, then starts `write(barrier, group)` on a background thread.

        Every process must call it at the same point (the first call makes a process group).

        Args:
            folder: The checkpoint folder being written.
            write: Writes the folder, synchronising processes with the barrier it is given; a
                sharded write's collectives run on `group` (the writers' own; None for one process).
        """
        self.wait()
        barrier, group = self._barrier(), self._group
        staged = self._staged
        if self._buffers.deferred:
            staged.clear()

        def run() -> None:
            try:
                write(barrier, group)
            finally:
                staged.set()  # however the write ended, a step never waits for good

        self._pending = PendingCheckpoint(folder, run)

    def fill(self) -> None:
        """The writing thread's first task (`StateSnapshot.fill`): the deferred copies, after which
        the optimizers' steps may go on, then their check (which may raise)."""
        try:
            self._buffers.fill()
        finally:
            self._staged.set()

    def wait(self) -> None:
        """Blocks until the write in flight, if any, has ended, and re-raises its error."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            # Interrupted while joining (Ctrl-C), the write is still running: it stays pending,
            # so no second write can start beside it.
            if pending.done:
                self._pending = None

    def close(self, wait: bool = True) -> None:
        """Waits for the write in flight (unless `wait` is False), then leaves the writers' group.

        Called by `end_training` and, for a script that never calls it, at interpreter exit. A
        later background save makes a new group.
        """
        try:
            if wait:
                self.wait()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks, self._guarded = [], weakref.WeakSet()
            group, self._group = self._group, None
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)

    def _barrier(self) -> Callable[[], None]:
        if not self._state.is_distributed:
            return no_barrier
        if self._group is None:
            # gloo whatever the default backend: a barrier on the CPU needs no device stream.
            self._group = dist.new_group(backend="gloo", timeout=collective_timeout())
        group = self._group
        return lambda: dist.barrier(group=group)


def _close_at_exit(owner: "weakref.ref[BackgroundCheckpoints]") -> None:
    """At interpreter exit: finishes a background write, unless a multi-process script is dying of
    an error (its peers may be gone, and the write would wait for them until the collective timeout)."""
    checkpoints = owner()
    if checkpoints is None:
        return
    try:
        checkpoints.close(wait=not (checkpoints._state.is_distributed and exiting_on_error()))
    except Exception as err:  # an atexit handler can only report
        warnings.warn(f"fittrain: the background checkpoint write still in flight at exit failed: {err!r}",
                      stacklevel=1)  # at exit there is no caller to point at
