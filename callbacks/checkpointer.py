"""Checkpointer: save the whole training state every n optimizer steps and/or every n epochs,
and, with a monitored metric, keep the best checkpoints."""

from __future__ import annotations

import math
import os
import pathlib
import secrets
import warnings
from typing import TYPE_CHECKING, Any

from fittrain.checkpoint import CheckpointError
from fittrain.checkpoint.arguments import check_async_save
from fittrain.checkpoint.naming import PREFIX, ProjectConfiguration, delete_checkpoints, is_checkpoint_name
from fittrain.common.checks import check_choice, check_positive_int
from fittrain.common.reprs import short_repr
from fittrain.trainer.events import Callback, RunRequest
from fittrain.trainer.monitor import Monitor

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


def _check_count(name: str, value: Any, fix: str = "") -> int | None:
    return check_positive_int(name, value, owner="Checkpointer", optional=True, fix=fix)


def _check_monitoring(monitor: Any, mode: Any, save_top_k: Any, restore_best: Any,
                      total_limit: Any) -> Monitor | None:
    """Checks the best-checkpoint arguments together, since most of them need `monitor`; returns its Monitor."""
    watched = None if monitor is None else Monitor(monitor, mode, owner="Checkpointer",
                                                   wanted="a metric name such as 'val_loss', or None")
    check_choice("mode", mode, ("min", "max"), owner="Checkpointer")
    if not isinstance(restore_best, bool):
        raise TypeError(f"`Checkpointer(restore_best=...)` must be True or False. Received: "
                        f"restore_best={short_repr(restore_best)} (type {type(restore_best).__name__}).")
    needing = [f"{name}={value!r}" for name, value in (("save_top_k", save_top_k), ("restore_best", restore_best))
               if value is not None and value is not False]
    if monitor is None and needing:
        raise ValueError(f"`Checkpointer({needing[0]})` needs monitor=...: it ranks checkpoints by a metric. "
                         f"Received: {needing[0]}, monitor=None. Pass monitor='val_loss' (or another metric "
                         "that validation produces), or total_limit=... to keep the newest checkpoints.")
    if monitor is not None and total_limit is not None:
        raise ValueError(f"`Checkpointer(total_limit=...)` cannot be combined with monitor=...: total_limit deletes "
                         f"the oldest checkpoints, which may be the best ones. Received: total_limit={total_limit}, "
                         f"monitor={monitor!r}, save_top_k={save_top_k}. Pass save_top_k=... instead (it keeps the "
                         "best k checkpoints plus the newest) and leave total_limit=None.")
    return watched


class _Ranking:
    """The monitored checkpoints not yet deleted, in save order, with their scores.

    The best is first by the monitor's mode (`Monitor.rank_key`: NaN and infinite scores rank
    below every finite one), and a tie goes to the earlier save. The top k plus the newest are kept.
    """

    def __init__(self, monitor: Monitor | None, top_k: int | None) -> None:
        self._monitor = monitor
        self._top_k = top_k
        self.entries: list[tuple[float, str]] = []

    def _ordered(self) -> list[int]:
        rank = self._monitor.rank_key
        return sorted(range(len(self.entries)), key=lambda i: (*rank(self.entries[i][0]), i))

    def best(self) -> tuple[float, str]:
        """The best entry's (score, name); call only when there are entries."""
        return self.entries[self._ordered()[0]]

    def beaten(self) -> list[str]:
        """The names neither among the top k nor the newest; none without a top k."""
        if self._top_k is None:
            return []
        keep = set(self._ordered()[:self._top_k]) | {len(self.entries) - 1}
        return [name for i, (_, name) in enumerate(self.entries) if i not in keep]

    def forget(self, names: list[str]) -> None:
        gone = set(names)
        self.entries = [entry for entry in self.entries if entry[1] not in gone]


_NOT_FINITE = ("nan", "inf", "-inf")


def _encode(entries: list[tuple[float, str]]) -> list[list[Any]]:
    """JSON-safe [score, name] pairs: a NaN or infinite score is written as 'nan', 'inf' or '-inf'."""
    return [[score if math.isfinite(score) else repr(score), name] for score, name in entries]


def _decode(raw: Any) -> list[tuple[float, str]]:
    """Reads what `_encode` wrote, refusing anything else (a name that is not checkpoint_{i} above all,
    since the names are deleted)."""
    entries = []
    for item in raw if isinstance(raw, list) else [raw]:
        pair = isinstance(item, (list, tuple)) and len(item) == 2
        score, name = item if pair else (None, None)
        number = isinstance(score, (int, float)) and not isinstance(score, bool)
        spelled = isinstance(score, str) and score in _NOT_FINITE
        if not (isinstance(name, str) and is_checkpoint_name(name) and (number or spelled)):
            raise CheckpointError(
                f"The Checkpointer's state in this checkpoint holds a damaged ranking entry: {item!r:.120}. "
                f"Each must be [score, '{PREFIX}<i>']. Resume from another checkpoint, or without monitor=....")
        entries.append((float(score), name))
    return entries


def _check_writable(folder: pathlib.Path) -> None:
    """Creates `folder` and a probe file in it, so an unwritable folder fails now, not at the first save.

    Raises:
        OSError: of the same kind and errno as the failure, naming the folder and the fix.
    """
    probe = folder / f".write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        raise OSError(
            err.errno,
            f"Checkpointer cannot write checkpoints to {str(folder)!r}: {err.strerror or err}. Pass a "
            "writable project_dir to the Trainer (or to the Accelerator's ProjectConfiguration), or make "
            "that folder writable.",
        ) from err


class Checkpointer(Callback):
    """Saves checkpoints with `accelerator.save_state()` into the run's folder.

    The folders are `{project_dir}/checkpoints/{run_name}/checkpoint_{i}`: each fit is a run with
    its own folder (`trainer.run_name`, which also names its logs), and `i` counts that run's
    saves from 0. Each folder holds everything a resume needs (model, optimizer, scheduler,
    scaler, RNG, data position, trainer and callback states); `model.safetensors` loads with
    safetensors alone. A resumed run saves on into its run's folder, numbering on after its
    newest folder, so nothing is ever overwritten; `total_limit` and `save_top_k` delete only
    folders of this run, never another run's. Every process takes part in a save (it is
    collective); only the main process writes shared files. A step is saved at most once, even
    when both triggers fire.

    With `async_save=True` a save copies the state to CPU memory and returns; the files are
    written on a background thread while training goes on, and the folder appears when they are
    complete. The next save, a preemption save, the end of fit and an exception wait for it.

    With `monitor`, each save records the metric's latest value (saves come after the validation
    of their step or epoch), and `trainer.best_checkpoint` and `trainer.best_score` name the best
    save so far. With `save_top_k`, only the k best checkpoints plus the newest are kept (the
    newest, so that `resume_from="latest"` resumes exactly); the others are deleted by the main
    process once the newer save is committed. The ranking travels in checkpoints: a resumed run
    keeps ranking and deleting (a run started from another run's checkpoint ranks only its own
    saves). Folders it never ranked (a preemption save) are never deleted.

    Args:
        every_n_steps: Save after every n-th optimizer step (accumulated batches count once).
        every_n_epochs: Save at the end of every n-th epoch, after its validation.
        total_limit: Keep only the newest this many checkpoints. None keeps the Accelerator's
            setting (unlimited unless configured).
        async_save: Write checkpoints on a background thread; training stalls only while the
            state is copied to CPU memory (a copy that is kept for the next save). See
            `Accelerator.save_state`.
        monitor: The metric that ranks checkpoints, such as "val_loss" or a name that
            `validation_step` returns; None ranks nothing.
        mode: "min" if lower is better, "max" if higher is better.
        save_top_k: Keep the k best checkpoints plus the newest; None keeps all. Needs `monitor`;
            not combined with `total_limit`.
        restore_best: At the end of fit, load the best checkpoint's weights into the module (on
            every process). Needs `monitor`.

    Raises:
        ValueError: when neither trigger is given, for a value that is not a positive integer,
            for a bad `monitor` or `mode`, for `save_top_k` or `restore_best` without `monitor`,
            and for `total_limit` with `monitor`; during fit, when `monitor` is not among the
            metrics at the first save.
        TypeError: when `async_save` or `restore_best` is not a bool.

    Example:
        >>> Trainer(callbacks=[Checkpointer(every_n_epochs=1, total_limit=3)]).fit(module, loader)
        >>> Trainer(resume_from="latest").fit(module, loader)  # continues the run, with the next number
        >>> Checkpointer(every_n_steps=500, async_save=True)  # training goes on while it writes
        >>> Checkpointer(every_n_epochs=1, monitor="val_acc", mode="max", save_top_k=3, restore_best=True)
    """

    def __init__(self, every_n_steps: int | None = None, every_n_epochs: int | None = None,
                 total_limit: int | None = None, async_save: bool = False, monitor: str | None = None,
                 mode: str = "min", save_top_k: int | None = None, restore_best: bool = False) -> None:
        self.every_n_steps = _check_count("every_n_steps", every_n_steps)
        self.every_n_epochs = _check_count("every_n_epochs", every_n_epochs)
        self.total_limit = _check_count("total_limit", total_limit)
        self.save_top_k = _check_count("save_top_k", save_top_k, "Pass None to keep every checkpoint.")
        self._monitor = _check_monitoring(monitor, mode, save_top_k, restore_best, total_limit)
        self.monitor, self.mode, self.restore_best = monitor, mode, restore_best
        if every_n_steps is None and every_n_epochs is None:
            raise ValueError("`Checkpointer` needs a trigger: pass every_n_steps=... and/or every_n_epochs=... "
                             "Received: every_n_steps=None, every_n_epochs=None.")
        self.async_save = check_async_save(async_save, "Checkpointer")
        self.last_checkpoint: str | None = None
        self._seen_step = 0
        self._last_saved_step: int | None = None
        self._ranking = _Ranking(self._monitor, self.save_top_k)
        self._config: ProjectConfiguration | None = None
        self._saving: float | None = None  # the score of the save in progress, for state_dict

    def run_request(self) -> RunRequest:
        """It saves checkpoints into the run's folder: the Trainer takes one such callback."""
        return RunRequest(saves_checkpoints=True)

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Switches the Accelerator to automatic checkpoint naming, which a user's Accelerator may lack,
        and checks that the checkpoint folder is writable before the first step, not at the first save."""
        config = trainer.accelerator.project_configuration
        config.automatic_checkpoint_naming = True
        if config.project_dir is None:
            config.set_directories(trainer.project_dir)
        if self.total_limit is not None:
            config.total_limit = self.total_limit
        self.last_checkpoint, self._seen_step, self._last_saved_step = None, 0, None
        self._config, self._ranking = config, _Ranking(self._monitor, self.save_top_k)
        if self.monitor is not None:
            self._check_no_total_limit(config)
            trainer.best_checkpoint, trainer.best_score = None, None
        _check_writable(config.checkpoints_dir)  # every process writes files there

    def _check_no_total_limit(self, config: ProjectConfiguration) -> None:
        # The Accelerator's pruning would delete the oldest checkpoints, whatever their rank.
        if config.total_limit is not None:
            raise ValueError(
                f"`Checkpointer(monitor={self.monitor!r})` decides which checkpoints to delete, but the Accelerator's "
                f"ProjectConfiguration would also delete the oldest ones, maybe the best. Received: total_limit="
                f"{config.total_limit} in trainer.accelerator.project_configuration. Set it to None, and pass "
                "save_top_k=... to the Checkpointer to limit the checkpoints kept.")

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Notes the current step: a resumed run starts at its checkpoint's step, which is no new step.
        After a resume, the best checkpoint of the ranking just loaded is published."""
        self._seen_step = trainer.state.global_step
        if self._ranking.entries:
            self._publish(trainer)

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """Saves when this batch completed an optimizer step whose number is a multiple of `every_n_steps`."""
        step = trainer.state.global_step
        # Inside an accumulation window (or on a skipped batch) the step did not move: nothing new to save.
        if self.every_n_steps is None or step == self._seen_step:
            return
        self._seen_step = step
        if step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """Saves at the end of every `every_n_epochs`-th epoch."""
        if self.every_n_epochs is not None and (trainer.state.epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def _save(self, trainer: "Trainer") -> None:
        step = trainer.state.global_step
        if step == self._last_saved_step:  # both triggers hit this step, or the run resumed at it
            return
        score = self._read_score(trainer) if self.monitor is not None else None
        if self.async_save and self.monitor is not None:
            # The folders the previous save beat go only once that save is committed.
            trainer.accelerator.wait_for_checkpoint()
            self._delete_beaten(trainer)
        # Set before saving: this callback's state is written into the checkpoint being made.
        self._last_saved_step, self._saving = step, score
        try:
            self.last_checkpoint = trainer.accelerator.save_state(async_save=self.async_save)
        finally:
            self._saving = None
        if score is not None:
            self._ranking.entries.append((score, pathlib.Path(self.last_checkpoint).name))
            self._publish(trainer)
            if not self.async_save:
                self._delete_beaten(trainer)

    def _read_score(self, trainer: "Trainer") -> float:
        """The monitored value now, the main process's on every process (train_loss differs per process)."""
        metrics = trainer.state.metrics
        value, names = trainer.accelerator.broadcast((self._monitor.read(metrics), sorted(metrics)))
        if value is not None:
            return float(value)
        if self._ranking.entries:  # it was there before (a run that popped it): rank this save worst
            return math.nan
        raise ValueError(self._monitor.missing(
            names, "`Checkpointer(monitor=...)`", f" at the save after optimizer step {trainer.state.global_step}",
            "; and save after validations: every_n_epochs=..., or every_n_steps=... a multiple of "
            "Trainer(val_every_n_steps=...)"))

    def _publish(self, trainer: "Trainer") -> None:
        score, name = self._ranking.best()
        trainer.best_checkpoint, trainer.best_score = self._config.checkpoints_dir / name, score

    def _delete_beaten(self, trainer: "Trainer") -> None:
        """Deletes (on the main process) the checkpoints neither among the best `save_top_k` nor the newest."""
        beaten = self._ranking.beaten()
        if beaten and trainer.accelerator.is_main_process:
            delete_checkpoints(self._config.checkpoints_dir, beaten)
        self._ranking.forget(beaten)

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Waits for a checkpoint still being written: after fit, every save is on disk. Then deletes
        what the last save beat, and with `restore_best` loads the best weights into the module."""
        trainer.accelerator.wait_for_checkpoint()
        if self.monitor is None:
            return
        self._delete_beaten(trainer)
        if self._ranking.entries:
            self._publish(trainer)
        if self.restore_best:
            self._restore_best(trainer)

    def _restore_best(self, trainer: "Trainer") -> None:
        if trainer.best_checkpoint is None:
            warnings.warn(f"Checkpointer(restore_best=True) restored nothing: no checkpoint ranked by "
                          f"monitor={self.monitor!r} was saved in this fit, so the module keeps its last weights. "
                          "Train long enough for a save (every_n_steps / every_n_epochs).", stacklevel=2)
            return
        # Every process loads: DDP replicas stay equal; under FSDP2 each rank reads its shard of a
        # sharded checkpoint, or re-shards a full one (collectives every process joins), as a resume does.
        trainer.accelerator.checkpointing.restore_weights(trainer.best_checkpoint, trainer.module)

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Waits for a checkpoint still being written, so it is complete before the process may exit.

        A failure of that write is added to `exception` as a note; the original stays the error raised.
        """
        try:
            trainer.accelerator.wait_for_checkpoint()
        except Exception as err:
            exception.add_note(f"Checkpointer: the checkpoint being written in the background failed too: {err!r}")

    def state_dict(self) -> dict[str, Any]:
        """The last saved step, so a resumed run does not save that step again; with `monitor`, the
        ranking ([score, name] pairs, JSON-safe), including checkpoints still to be deleted."""
        state: dict[str, Any] = {"last_saved_step": self._last_saved_step}
        if self.monitor is None:
            return state
        entries = list(self._ranking.entries)
        if self._saving is not None:
            # Called by save_state while it captures this save, after it reserved the folder and moved
            # `iteration` past its number: the checkpoint ranks itself, so a resume from it knows it.
            entries.append((self._saving, f"{PREFIX}{self._config.iteration - 1}"))
        state.update(monitor=self.monitor, mode=self.mode, ranking=_encode(entries))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned; a ranking by another monitor or mode is left out."""
        saved = state.get("last_saved_step")
        self._last_saved_step = None if saved is None else int(saved)
        if self.monitor is None or "ranking" not in state:
            return
        if (state.get("monitor"), state.get("mode")) != (self.monitor, self.mode):
            warnings.warn(f"Checkpointer: the checkpoint ranked by monitor={state.get('monitor')!r:.80}, "
                          f"mode={state.get('mode')!r:.20}, not monitor={self.monitor!r}, mode={self.mode!r}. Its "
                          "ranking is left out: this run ranks (and deletes) only its own saves.", stacklevel=2)
            return
        entries = _decode(state["ranking"])
        if self._config is not None:
            # A new run started from another run's checkpoint: those names are another folder's, and
            # this run's own saves will reuse them. Only folders of this run are ranked (and deleted).
            folder = self._config.checkpoints_dir
            entries = [(score, name) for score, name in entries if (folder / name).is_dir()]
        self._ranking.entries = entries

    def __repr__(self) -> str:
        best = "" if self.monitor is None else (f", monitor={self.monitor!r}, mode={self.mode!r}, "
                                                f"save_top_k={self.save_top_k}, restore_best={self.restore_best}")
        return (f"Checkpointer(every_n_steps={self.every_n_steps}, every_n_epochs={self.every_n_epochs}, "
                f"total_limit={self.total_limit}, async_save={self.async_save}{best})")
