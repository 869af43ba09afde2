"""`validate/test/predict(ckpt_path=...)`: which checkpoint's weights to evaluate, as in Lightning.

`ckpt_path` is one of:

- "best": the best checkpoint the Trainer's Checkpointer saved (ranked by its `monitor`); without
  a monitor, its newest save, as Lightning's `best_model_path` is then the last one saved. It
  comes from this fit, or from the ranking a resumed fit loaded.
- "last": the Checkpointer's newest save (the one its `last` link leads to, with `save_last`);
  before any save, the newest save in its `dirpath`, if it has one. Lightning only looks for
  `last.ckpt` files and, finding none, warns and evaluates the module as it is; here that is an
  error, since evaluating other weights than asked is what a user would not notice.
- a checkpoint folder (relative to the working directory, or to the Trainer's `project_dir`);
- None: the module as it is.

The Checkpointer is found as the callback whose `run_request()` says it saves checkpoints, and
read through Lightning's attribute names (`best_model_path`, `last_checkpoint`, `dirpath`): the
Trainer layer imports no callback. The main process resolves and checks the folder (its manifest,
and the weights file's checksum) and tells every process, so all of them load or all raise;
then every process loads the model's weights (`Checkpointing.restore_weights`, as
`Checkpointer(restore_best=True)` does: DDP replicas alike, FSDP2 shards read or resharded).
Only the weights are loaded, never the optimizer or the data position. The main process prints
which checkpoint it restored, as Lightning does.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import TYPE_CHECKING, Any

from fittrain.checkpoint import MANIFEST_NAME, CheckpointError, CheckpointReader
from fittrain.checkpoint.latest import latest_checkpoint
from fittrain.checkpoint.run_folders import holds_checkpoints, saved_in_order
from fittrain.checkpoint.sharded import METADATA_PATH
from fittrain.common.reprs import short_repr
from fittrain.trainer.parts import check_path

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

_WEIGHTS = "model.safetensors"
# What each process raises when the main process refused `ckpt_path` (the message says why).
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
                                       "CheckpointError": CheckpointError}


def restore_for_evaluation(trainer: "Trainer", ckpt_path: str | os.PathLike | None, method: str) -> None:
    """Loads the weights `ckpt_path` names into `trainer.model` before `method` ("validate", "test",
    "predict") runs; None leaves the module as it is. Every process must call it.

    Raises:
        TypeError: for a `ckpt_path` that is neither a str nor a path.
        ValueError: for "best" or "last" without a Checkpointer, or before it saved anything.
        FileNotFoundError: for a folder that does not exist.
        CheckpointError: for a folder that is no checkpoint, an incomplete or a damaged one.
    """
    if ckpt_path is None:
        return
    check_path("ckpt_path", ckpt_path)
    acc = trainer.accelerator
    found, refusal = None, None
    if acc.is_main_process:
        try:
            found = str(_checked(_resolve(trainer, ckpt_path, method), ckpt_path, method))
        except (ValueError, FileNotFoundError, CheckpointError) as err:
            refusal = (type(err).__name__ if type(err).__name__ in _ERRORS else "CheckpointError", str(err))
    found, refusal = acc.broadcast((found, refusal))
    if refusal is not None:
        raise _ERRORS[refusal[0]](refusal[1])
    acc.checkpointing.restore_weights(found, trainer.model)
    acc.print(f"Trainer.{method}: restored the model's weights from {found} (ckpt_path={_shown(ckpt_path)}).")


def _shown(ckpt_path: str | os.PathLike) -> str:
    return short_repr(os.fspath(ckpt_path), 300)


def _checkpointer(trainer: "Trainer") -> Any:
    """The callback that saves checkpoints (`RunRequest.saves_checkpoints`), or None."""
    return next((cb for cb, request in trainer.events.run_requests() if request.saves_checkpoints), None)


def _resolve(trainer: "Trainer", ckpt_path: str | os.PathLike, method: str) -> pathlib.Path:
    """The folder `ckpt_path` names (not yet checked)."""
    where = f"Trainer.{method}(ckpt_path={_shown(ckpt_path)})"
    if ckpt_path in ("best", "last"):
        saver = _checkpointer(trainer)
        if saver is None:
            raise ValueError(f"{where} names a checkpoint of the Trainer's Checkpointer, and the Trainer has none. Add "
                             "fittrain.callbacks.Checkpointer(...) to its callbacks and fit first, or pass the path "
                             "of a checkpoint folder.")
        found = _best(saver) if ckpt_path == "best" else _last(saver)
        if found is None:
            raise ValueError(f"{where}: {type(saver).__name__} has saved no checkpoint yet (in this Trainer's fit, or "
                             "the run it resumed). Fit long enough for a save first (every_n_steps / every_n_epochs), "
                             "or pass the path of a checkpoint folder.")
        return found
    for candidate in (pathlib.Path(ckpt_path), pathlib.Path(trainer.project_dir) / ckpt_path):
        if os.path.lexists(candidate):
            return candidate
    raise FileNotFoundError(f"{where} names a folder that does not exist. Pass a checkpoint folder such as "
                            "'checkpoints/run_a/checkpoint_3', or 'best' / 'last' for the Checkpointer's.")


def _best(saver: Any) -> pathlib.Path | None:
    best = getattr(saver, "best_model_path", "")
    return pathlib.Path(best) if best else None


def _last(saver: Any) -> pathlib.Path | None:
    newest = getattr(saver, "last_checkpoint", None)
    if newest:
        return pathlib.Path(newest)
    folder = getattr(saver, "dirpath", None)
    if folder is not None and saved_in_order(pathlib.Path(folder)):
        return latest_checkpoint(pathlib.Path(folder), warnings.warn)  # a damaged newer one is named
    return None


def _checked(folder: pathlib.Path, ckpt_path: str | os.PathLike, method: str) -> pathlib.Path:
    """`folder` after checking it is a complete checkpoint whose weights file matches its manifest.

    Raises:
        CheckpointError: naming `ckpt_path`, the folder and what to pass instead.
    """
    where = f"Trainer.{method}(ckpt_path={_shown(ckpt_path)})"
    if folder.is_dir() and not (folder / MANIFEST_NAME).exists() and holds_checkpoints(folder):
        newest = saved_in_order(folder)
        hint = f", such as its newest, {str(newest[-1])!r}" if newest else ""
        raise CheckpointError(f"{where} names {str(folder)!r}, a folder of checkpoints, not a checkpoint. Pass one "
                              f"of them{hint}, or 'last'.")
    try:
        with CheckpointReader(folder) as reader:
            if not (reader.has(_WEIGHTS) or reader.has(METADATA_PATH)):
                raise CheckpointError(f"Checkpoint {str(folder)!r} holds no model weights ({_WEIGHTS} or sharded "
                                      f"{METADATA_PATH}).")
            if reader.has(_WEIGHTS):
                reader.verify([_WEIGHTS])  # a sharded checkpoint's shards are checked as they are read
    except (CheckpointError, NotADirectoryError) as err:
        raise CheckpointError(f"{where} cannot be loaded: {err} Pass a complete checkpoint folder that save_state or "
                              "a Checkpointer wrote, or 'best' / 'last'.") from None
    return folder.resolve()
