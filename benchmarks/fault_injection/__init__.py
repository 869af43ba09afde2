"""Fault injection: real faults against fittrain's checkpoints, and which of its promises held.

Every scenario attacks checkpoints the way production does, with real processes, signals, files
and file systems (nothing is mocked), then checks what fittrain promises, for full checkpoints
and for sharded ones (FSDP2, on 2 ranks):

- every ``checkpoint_N`` folder that exists verifies (`fittrain.checkpoint.is_intact`);
- ``resume_from="latest"`` and ``load_state()`` pick an intact checkpoint, and a resumed run ends
  with final weights ``torch.equal`` to those of an uninterrupted run;
- damage is reported as `fittrain.checkpoint.CheckpointError` naming the file (in at most 2,000
  characters), and a refused load leaves the live model, optimizer, scheduler, loaders and RNG as
  they were;
- nothing planted in a checkpoint executes, and nothing hangs: every wait has a deadline, after
  which every process the scenario started (torchrun's workers too) is killed and it fails as hung.

Categories (``--only`` takes these names):

1. kill-sync: SIGKILL a Trainer job that saves after every optimizer step
   (``Checkpointer(every_n_steps=1, total_limit=3)``) inside a save, and a random fraction of a
   step after several chosen steps; then a fresh process, seeded differently, resumes "latest" and
   must end exactly like an uninterrupted run. The checkpoints are found in either of the
   Trainer's layouts (``checkpoints/`` or ``checkpoints/<run>/``).
2. kill-async: the same with ``Checkpointer(every_n_steps=1, total_limit=3, async_save=True)``.
3. disk-full: on a small tmpfs (root only; skipped otherwise), a save that runs out of space
   raises OSError "No space left on device", leaves the previous checkpoint intact and nothing
   behind, and a retry succeeds once a filler file is deleted. The tmpfs is always unmounted.
4. damaged: truncate, flip a byte in, or delete each file of the newest checkpoint in turn:
   loading it raises CheckpointError naming that file, and "latest" falls back to the previous one.
5. hostile: a pickle whose ``__reduce__`` writes a marker file (listed in the manifest with a
   correct checksum), a manifest nested 100,000 deep, a huge or garbage accelerator_state.json,
   JSON of the wrong types: nothing executes or hangs, only CheckpointError escapes, and "latest"
   skips such a checkpoint with a warning.
6. two-writers: two processes save into one project at once: every checkpoint that exists is
   intact, every save that returned is on disk with its own writer's files, and a save that
   fails says so with a CheckpointError rather than a raw OSError.
7. sigterm-rank: a 2-process torchrun Trainer job (gloo, CPU) where SIGTERM reaches one rank only,
   or the whole process group: every rank exits 75 (as torchrun's failure summary reports it or,
   where torchrun prints none, as the rank recorded on its way out), and "latest" resumes exactly.
8. sharded-kill: a 2-process FSDP2 job (torchrun, gloo, CPU) saving sharded checkpoints after every
   step, synchronously or with ``async_save=True``, gets SIGKILL on rank 1, rank 0, or every rank
   and torchrun while a save is half written: every checkpoint left verifies, no temporary folder
   is listed as a checkpoint, and a second 2-rank job loads "latest", the newest intact folder,
   with each rank's state bitwise equal to the state recorded just before that save.
9. sharded-files: on 2 ranks, damaged (truncated, a byte flipped, deleted, emptied) and hostile
   (rewritten with matching checksums) versions of every sharded file: ``shards/__{rank}_0.distcp``,
   ``shards/metadata.json`` (partial chunk coverage, absurd sizes, a chunk without storage, no
   "items", thousands of dimensions), ``shards/values.pt`` (garbage state, ``lr="evil"``,
   ``betas="xx"``, no param groups, other param groups, a planted pickle), ``data_states_{rank}.pt``
   (positions past the loader, a planted pickle) and the manifest, checked as in 4 and 5 on every
   rank; one job builds the sharded project once and attacks copies of it.

Reading the output: a line per category with ``survived/tried`` and its time (or why it was
skipped), a ``FAIL`` line per failed scenario saying what went wrong (its first problems,
separated by " | "), and a total line:

    kill-sync     4/4 survived (46 s)
    disk-full     skipped: not running as root (mount -t tmpfs needs it)
    hostile       17/18 survived (6 s)
      FAIL manifest nested 100,000 deep: is_intact() raised RecursionError: maximum recursion ...
    total: 52/53 survived (skipped: disk-full)

The script exits 0 whatever the scenarios found: a failed scenario is a finding, not an error of
the script. Kill moments are random from ``--seed`` (printed first), so a run can be repeated.
Everything is written to a temporary folder that is deleted at the end.

Usage:
    python -m benchmarks.fault_injection                  # everything: a few minutes on 2 cores
    python -m benchmarks.fault_injection --quick          # one scenario per category (sharded-files: 9)
    python -m benchmarks.fault_injection --only hostile --seed 7
"""

import os

# Every job runs on the CPU: set before any module of the package imports torch.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
