"""Which checkpoint "latest" means: the newest intact folder, and the newest that loads.

Newest means saved last (`run_folders.saved_in_order`), never the greatest name: a template's
"epoch=10" sorts before "epoch=9". `latest_checkpoint` checks every file of a candidate against
its manifest, newest first, and warns about each damaged folder it passes over; `load_newest`
also passes over one whose files are refused only when they are parsed. A folder pruned
meanwhile by a run still saving is passed over silently; a `CheckpointMismatchError` is never
passed over (an older folder would not fit either). `latest_run_checkpoint` picks the run first:
the Trainer's "latest" is the newest intact checkpoint of the most recently started run that
holds one (`run_folders`).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

from fittrain.checkpoint.checks import check_meta_fields
from fittrain.checkpoint.errors import CheckpointDeletedError, CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.naming import PREFIX, list_checkpoints
from fittrain.checkpoint.reader import CheckpointReader
from fittrain.checkpoint.run_folders import run_folders, saved_in_order
from fittrain.checkpoint.snapshot import META_NAME

# How often `latest_checkpoint` lists the folder again after a candidate vanished under it.
_LISTINGS = 20
# How many listings that show no intact checkpoint (and no folder vanishing) it takes to believe it.
_EMPTY_LISTINGS = 3


def latest_checkpoint(root: pathlib.Path, warn: Callable[[str], None],
                      damaged: set[pathlib.Path] | None = None) -> pathlib.Path:
    """The newest intact checkpoint under `root` by save order, warning about damaged newer ones.

    Every file of a candidate is checked against its manifest (size and CRC32); the warning for a
    folder passed over names the file that failed. A folder that vanishes while it is checked was
    pruned by a run still saving, which commits a newer one first: the listing is read again,
    without a warning.

    Args:
        root: The folder holding the checkpoints.
        warn: Called with the warning for each damaged folder passed over.
        damaged: Folders already known to be damaged, passed over without a look; the damaged
            folders found are added to it.

    Raises:
        FileNotFoundError: when `root` holds no intact checkpoint.
    """
    damaged = set() if damaged is None else damaged
    for listing in range(_LISTINGS):
        found, vanished = _newest_intact(saved_in_order(root), warn, damaged)
        if found is not None:
            return found
        # Nothing intact. A folder that vanished while it was checked was pruned after a newer one
        # was committed; and a listing read while another process renames folders may miss both
        # the new folder and the old one (readdir does not see a directory at one instant). So a
        # listing that found nothing is read again before this concludes there is no checkpoint.
        if not vanished and listing >= _EMPTY_LISTINGS - 1:
            break
    raise FileNotFoundError(f"No complete checkpoint found under {root}. Save one with save_state() first.")


def latest_run_checkpoint(root: pathlib.Path, warn: Callable[[str], None]) -> pathlib.Path:
    """The newest intact checkpoint of the latest started run under `root` that holds one.

    Runs are taken in the order they started (their run.json), never by folder times or names;
    within a run, `latest_checkpoint` passes over damaged folders as for one folder of checkpoints.

    Args:
        root: `{project_dir}/checkpoints`, which holds one folder per run.
        warn: Called with the warning for each damaged folder passed over.

    Raises:
        FileNotFoundError: when no run under `root` holds an intact checkpoint.
    """
    for run in run_folders(root):
        try:
            return latest_checkpoint(run, warn)
        except FileNotFoundError:
            continue  # a run that saved nothing intact yet: the run started before it
    flat = list_checkpoints(root, PREFIX)
    hint = (f" It holds {flat[-1].name} and others in the flat layout of a plain Accelerator: pass one as "
            f"resume_from=...." if flat else " Save one with a Checkpointer first.")
    raise FileNotFoundError(f"No run folder under {root} holds a complete checkpoint.{hint}")


def load_newest(root: pathlib.Path, warn: Callable[[str], None], load: Callable[[pathlib.Path], Any]) -> Any:
    """Loads the newest loadable checkpoint under `root` with `load`, and returns what it returns.

    A folder whose files prove damaged only when `load` reads them (their checksums match, but a
    file is refused, such as a planted pickle) is passed over with a warning, like one that fails
    its checksums; one pruned meanwhile is passed over silently. `load` changes nothing when it
    raises, so the next older folder can be tried.

    Raises:
        FileNotFoundError: when no loadable checkpoint is left.
        CheckpointMismatchError: when the newest intact checkpoint does not fit this run (an older
            one would not either).
    """
    damaged: set[pathlib.Path] = set()
    pruned = 0
    while True:  # each turn adds a folder to `damaged` or counts a pruned one: it ends
        folder = latest_checkpoint(root, warn, damaged)
        try:
            return load(folder)
        except CheckpointMismatchError:
            raise
        except (CheckpointDeletedError, FileNotFoundError):
            pruned += 1  # pruned after it was chosen: a newer one exists, so choose again
            if pruned >= _LISTINGS:
                raise
        except CheckpointError as err:
            damaged.add(folder)
            warn(f"Skipping checkpoint {folder}: it is damaged, so an older one is used. Detail: {err}")


def _verify(reader: CheckpointReader) -> None:
    """Checks every file's checksum, and that accelerator_state.json is there and well formed.

    That file is small and parsed here too, so a garbled one (with a matching checksum) counts as
    damage, which "latest" skips, rather than failing the load that would follow.
    """
    reader.verify()
    if not reader.has(META_NAME):
        raise CheckpointError(f"Checkpoint {reader.path} is incomplete: it has no {META_NAME}.")
    check_meta_fields(reader.path / META_NAME, reader.read_json(META_NAME))


def _newest_intact(folders: list[pathlib.Path], warn: Callable[[str], None],
                   damaged: set[pathlib.Path]) -> tuple[pathlib.Path | None, bool]:
    """The newest intact folder of `folders` (or None), and whether one vanished while checked.

    Folders in `damaged` are skipped; newly found damaged ones are added and warned about once.
    """
    for folder in reversed(folders):
        if folder in damaged:
            continue
        try:
            _verify(CheckpointReader(folder))
            return folder, False
        except CheckpointDeletedError:
            return None, True
        except FileNotFoundError:
            return None, True  # renamed away between the listing and the first look
        except (CheckpointError, OSError) as err:
            damaged.add(folder)
            warn(f"Skipping checkpoint {folder}: it is incomplete or damaged, so an older one is used. "
                 f"Detail: {err}")
    return None, False

