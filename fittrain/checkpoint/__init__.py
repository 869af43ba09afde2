"""Checkpoints: crash-safe, verified folders that save and restore a whole run.

One folder (its files: `snapshot`), written atomically and verified on every read:

    {project_dir}/checkpoints/[{run}/]checkpoint_{i}/  automatic naming (`naming`; the Trainer adds
                                                  a folder per run, `run_folders`); any folder otherwise
        model.safetensors, optimizer.pt, ...      weights, state dicts (weights_only), scaler.pt
        shards/                                   instead, state_dict_type="sharded" (FSDP2's default):
                                                  each rank's shards as raw bytes + metadata.json (`sharded`)
        random_states_{rank}.pt                   every RNG of each rank
        data_states_{rank}.pt                     each loader's state on each rank (streams, samplers, the
                                                  epoch's order consumed by all ranks: elastic resume)
        custom_checkpoint_{i}.pt                  objects given to register_for_checkpointing
        accelerator_state.json                    step, data positions, process count, precision
        <files and folders of save hooks>         what register_save_state_pre_hook hooks wrote (`hooks`)
        manifest.json                             every file's size and CRC32, written last
    {project_dir}/checkpoints/.checkpoint_{i}.tmp a save in progress, claimed by one writer

Save (`Accelerator.save_state`, in `fittrain.accelerator.checkpointing`):
    naming.reserve_target      the main process claims the next number, and tells every process
    snapshot.capture_state     live objects -> a StateSnapshot of plain data (for async_save=True
                               copied into reused CPU buffers, then written by `background`)
    snapshot.write_checkpoint  folder.atomic_checkpoint: each rank streams its files (fastio) and,
                               sharded, writes its shards with DCP; the main rank writes the
                               manifest last (every rank's checksums) and renames (renames)
    ProjectConfiguration.prune after the commit only: a failed save deletes nothing

Load (`Accelerator.load_state`, `Trainer(resume_from=...)`):
    latest.load_newest         newest first; a damaged or pruned folder is passed over
    reader.CheckpointReader    each file checked against the manifest before it is parsed
    restore.read_state         read everything, `checks` it against the live run; changes nothing
                               (on M processes: loaders re-deal the rest of the epoch, new ranks'
                               RNG is derived; shards verified, each rank a share, on a thread)
    restore.apply_state        restore the live objects (shards: DCP reshards), RNG (`rng`) last

Modules: naming, latest, run_folders (where checkpoints go, which is newest); snapshot, restore,
checks, rng, hooks (what is saved, and how it is read back and checked); folder, fastio, reader,
crc, temp_folders, renames, errors (the atomic verified folder); background (async saves);
sharded, dcp_io (DCP shards); model_io, consolidate (safetensors weights); arguments (the checks
of save_state/load_state/Checkpointer arguments).

May import: `data.position` (the keys of a saved loader state), `distributed` (process state,
teardown) and `common`. Never the Accelerator or the Trainer, which drive it.
"""

from fittrain.checkpoint.errors import CheckpointDeletedError, CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.fastio import MANIFEST_NAME, CheckpointWriter
from fittrain.checkpoint.folder import atomic_checkpoint
from fittrain.checkpoint.latest import latest_checkpoint, load_newest
from fittrain.checkpoint.model_io import load_model_weights, save_model_weights
from fittrain.checkpoint.naming import CHECKPOINTS_DIR, ProjectConfiguration, list_checkpoints
from fittrain.checkpoint.reader import CheckpointReader, is_intact

__all__ = [
    "CHECKPOINTS_DIR", "MANIFEST_NAME", "CheckpointDeletedError", "CheckpointError",
    "CheckpointMismatchError", "CheckpointReader", "CheckpointWriter", "ProjectConfiguration",
    "atomic_checkpoint", "is_intact", "latest_checkpoint", "list_checkpoints", "load_model_weights",
    "load_newest", "save_model_weights",
]
