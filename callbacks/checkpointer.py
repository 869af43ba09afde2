"""Checkpointer: save the whole training state every n optimizer steps and/or every n epochs, into
the run's folder or `dirpath`, named by number or by a Lightning `filename` template; with a
monitored metric, keep the best checkpoints; with `save_last`, keep a `last` link to the newest."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import TYPE_CHECKING, Any

from fittrain.checkpoint import CheckpointError
from fittrain.checkpoint.arguments import check_async_save
from fittrain.checkpoint.naming import ProjectConfiguration, delete_checkpoints
from fittrain.checkpoint.run_folders import holds_checkpoints, is_plain_name
from fittrain.common.checks import check_bool, check_choice, check_positive_int
from fittrain.common.reprs import short_repr
from fittrain.trainer.events import Callback, RunRequest
from fittrain.trainer.monitor import Monitor

from .checkpoint_names import (
    MONITOR_REFUSAL,
    LastLink,
    NameTemplate,
    Ranking,
    SavePlan,
    candidate_names,
    check_dirpath,
    check_save_last,
    check_writable,
    decode_ranking,
    encode_ranking,
    plan_save,
)

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


class Checkpointer(Callback):
    """Saves checkpoints with `accelerator.save_state()` into the run's folder, or `dirpath`.

    By default the folders are `{project_dir}/checkpoints/{run_name}/checkpoint_{i}`, `i` counting
    the run's saves; with `dirpath` they go into that folder (runs may share it), and with
    `filename` each is named by Lightning's template ("{epoch}-{step}" -> "epoch=2-step=30"; a
    name that exists gets "-v1", "-v2", ...: nothing is overwritten). Every save is an atomic,
    verified folder holding everything a resume needs; `model.safetensors` loads with safetensors
    alone. The order of saves is recorded (saves.json), so "latest" resumes the newest save, never
    the greatest name; a resumed run saves on in its folder, numbering, ranking and versioning on.
    `total_limit` and `save_top_k` delete only folders this run saved. Every process takes part
    in a save; the main process writes shared files. A step is saved at most once.

    With `monitor`, each save records the metric's latest value (saves come after the validation
    of their step or epoch), and `trainer.best_checkpoint` / `trainer.best_score` name the best so
    far. With `save_top_k`, the k best plus the newest (which an exact resume needs) are kept; the
    ranking travels in checkpoints. Folders it never ranked (a preemption save) are never deleted.
    With `save_last`, `last` is a symbolic link to the newest save, swapped in one rename once that
    save is committed: it always leads to a complete checkpoint and costs no copy (a copy where
    links cannot be made). Its name is `CHECKPOINT_NAME_LAST` (a template) plus `FILE_EXTENSION`.

    Lightning's attributes are kept on every process: `best_model_path` (without `monitor`, the
    newest save), `best_model_score`, `best_k_models` (path -> score), `kth_best_model_path`,
    `last_model_path` (the link), and `last_checkpoint` (the newest save); paths are str, "" before
    any save. `Trainer.test(ckpt_path="best"|"last")` reads them. See docs/checkpoints.md.

    Args:
        every_n_steps: Save after every n-th optimizer step (accumulated batches count once).
        every_n_epochs: Save at the end of every n-th epoch, after its validation; with `monitor`,
            when the fit validates mid-epoch or not every epoch, after each validation of every
            n-th epoch instead (`saves_after_validation`).
        total_limit: Keep only the newest this many of this run's checkpoints. None keeps the
            Accelerator's setting (unlimited unless configured).
        async_save: Write checkpoints on a background thread, training going on meanwhile (see
            `Accelerator.save_state`); the next save, the end of fit and an exception wait for it.
        monitor: The metric that ranks checkpoints, such as "val_loss" or a name that
            `validation_step` returns; None ranks nothing.
        mode: "min" if lower is better, "max" if higher is better.
        save_top_k: Keep the k best checkpoints plus the newest; None keeps all. Needs `monitor`;
            not combined with `total_limit`.
        restore_best: At the end of fit, load the best checkpoint's weights into the module (on
            every process). Needs `monitor`.
        dirpath: The folder to save into instead of the run's (relative to the working directory,
            as in Lightning); created and checked writable when fit starts.
        filename: A Lightning template of "{epoch}", "{step}" and metric names with format specs,
            such as "{epoch}-{val_loss:.3f}"; a metric it names must exist at every save. None
            names saves `checkpoint_{i}`.
        save_last: True (or Lightning's "link", the same here) keeps `last` leading to the newest
            save; a fit that saved nothing saves once when training ends, as in Lightning.
        auto_insert_metric_name: Write each field's name before its value ("epoch=3"); False
            writes values alone (and allows a metric name with '/' in `filename`).

    Raises:
        ValueError: when neither trigger is given, for a value that is not a positive integer,
            for a bad `monitor`, `mode`, `filename` or `save_last`, for `save_top_k` or
            `restore_best` without `monitor`, and for `total_limit` with `monitor`; during fit,
            when `monitor` or a metric `filename` names is not among the metrics at the first save.
        TypeError: when `async_save`, `restore_best` or `auto_insert_metric_name` is not a bool,
            or `dirpath` is not a path.

    Example:
        >>> Trainer(callbacks=[Checkpointer(every_n_epochs=1, total_limit=3)]).fit(module, loader)
        >>> Trainer(resume_from="latest").fit(module, loader)  # continues the run, with the next number
        >>> Checkpointer(every_n_steps=500, async_save=True)  # training goes on while it writes
        >>> Checkpointer(every_n_epochs=1, monitor="val_acc", mode="max", save_top_k=3, restore_best=True)
        >>> Checkpointer(every_n_epochs=1, dirpath="ckpts", filename="{epoch}-{val_loss:.3f}", save_last=True)
    """

    #: Lightning's names: what joins a name to its version ("-v1"), a field's name to its value
    #: ("epoch=3"), the `last` link's name (a template), an extension for every name (none:
    #: checkpoints are folders), and the first version number.
    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ""
    STARTING_VERSION = 1
    #: How a save refuses a monitored metric that does not exist: the argument, a further fix.
    monitor_refusal = MONITOR_REFUSAL

    def __init__(self, every_n_steps: int | None = None, every_n_epochs: int | None = None,
                 total_limit: int | None = None, async_save: bool = False, monitor: str | None = None,
                 mode: str = "min", save_top_k: int | None = None, restore_best: bool = False,
                 dirpath: str | os.PathLike | None = None, filename: str | None = None,
                 save_last: bool | str = False, auto_insert_metric_name: bool = True) -> None:
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
        self.dirpath = check_dirpath(dirpath)
        self.save_last = check_save_last(save_last)
        self.auto_insert_metric_name = check_bool("auto_insert_metric_name", auto_insert_metric_name,
                                                  owner="Checkpointer")
        self.filename = filename
        self._names = self._templates()  # checks the filename (and CHECKPOINT_NAME_LAST) now; rebuilt at fit start
        self._reset()
        self._config: ProjectConfiguration | None = None

    def _templates(self) -> tuple[NameTemplate | None, NameTemplate | None]:
        """The filename's and the last link's templates, built with the class attributes as they are now."""
        names = None if self.filename is None else NameTemplate(
            self.filename, self.auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR)
        last = None if not self.save_last else NameTemplate(self.CHECKPOINT_NAME_LAST, self.auto_insert_metric_name,
                                                            self.CHECKPOINT_EQUALS_CHAR, "CHECKPOINT_NAME_LAST")
        return names, last

    def _reset(self) -> None:
        """What one fit starts without: its saves, ranking, link and Lightning's attributes."""
        self.last_checkpoint: str | None = None
        self.best_model_path, self.last_model_path, self.kth_best_model_path = "", "", ""
        self.best_model_score: float | None = None
        self.best_k_models: dict[str, float] = {}
        self._seen_step = 0
        self._last_saved_step: int | None = None
        self._ranking = Ranking(self._monitor, self.save_top_k)
        self._newest: str | None = None  # the newest save's folder name
        self._link: LastLink | None = None  # made at fit start, when its folder is known
        self._saving: SavePlan | None = None  # the save in progress, for state_dict
        self._saved = False  # whether this fit saved (save_last saves at its end otherwise)
        self._training = False  # between on_train_start and on_train_end
        self._validated = False  # a validation asked for a save at the end of its batch or epoch
        self._resumed = False

    def run_request(self) -> RunRequest:
        """It saves checkpoints into the run's folder: the Trainer takes one such callback."""
        return RunRequest(saves_checkpoints=True)

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Switches the Accelerator to automatic checkpoint naming (which a user's Accelerator may lack),
        points it at `dirpath`, and checks that the folder is writable before the first step."""
        config = trainer.accelerator.project_configuration
        config.automatic_checkpoint_naming = True
        if config.project_dir is None:
            config.set_directories(trainer.project_dir)
        if self.total_limit is not None:
            config.total_limit = self.total_limit
        config.use_folder(self.dirpath)
        self._config, self._names = config, self._templates()
        self._reset()
        self._link = LastLink(config.checkpoints_dir, self.CHECKPOINT_JOIN_CHAR, self.STARTING_VERSION,
                              self.FILE_EXTENSION)
        if self.monitor is not None:
            self._check_no_total_limit(config)
            trainer.best_checkpoint, trainer.best_score = None, None
        given = "a writable dirpath" if self.dirpath else ("a writable project_dir to the Trainer (or to the "
                                                           "Accelerator's ProjectConfiguration)")
        check_writable(config.checkpoints_dir, given)  # every process writes files there

    def _check_no_total_limit(self, config: ProjectConfiguration) -> None:
        # The Accelerator's pruning would delete the oldest checkpoints, whatever their rank.
        if config.total_limit is not None:
            raise ValueError(
                f"`Checkpointer(monitor={self.monitor!r})` decides which checkpoints to delete, but the Accelerator's "
                f"ProjectConfiguration would also delete the oldest ones, maybe the best. Received: total_limit="
                f"{config.total_limit} in trainer.accelerator.project_configuration. Set it to None, and pass "
                "save_top_k=... to the Checkpointer to limit the checkpoints kept.")

    def on_train_start(self, trainer: "Trainer") -> None:
        """Says when `dirpath` holds checkpoints this run did not resume from (they are kept beside its own)."""
        self._training = True  # until on_train_end or an exception: validations now are the fit's
        folder = self._config.checkpoints_dir
        if self.dirpath and not self._resumed and trainer.accelerator.is_main_process and holds_checkpoints(folder):
            warnings.warn(f"Checkpointer(dirpath={self.dirpath!r}) holds checkpoints already. This run saves beside "
                          "them (a name that exists gets -v1, -v2, ...) and deletes only its own; resume_from="
                          "'latest' picks the newest save there.", stacklevel=2)

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Notes the current step: a resumed run starts at its checkpoint's step, which is no new step.
        After a resume, the best checkpoint of the ranking just loaded is published."""
        self._seen_step = trainer.state.global_step
        if self._ranking.entries:
            self._publish(trainer)

    def on_train_batch_end(self, trainer: "Trainer") -> None:
        """Saves when this batch completed an optimizer step whose number is a multiple of `every_n_steps`,
        or when its validation asked for the epoch's save (`saves_after_validation`)."""
        if self._validated:
            self._validated = False
            self._save(trainer)
        step = trainer.state.global_step
        # Inside an accumulation window (or on a skipped batch) the step did not move: nothing new to save.
        if self.every_n_steps is None or step == self._seen_step:
            return
        self._seen_step = step
        if step % self.every_n_steps == 0:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: "Trainer") -> None:
        """Saves at the end of every `every_n_epochs`-th epoch (unless `saves_after_validation`), or when the
        epoch's closing validation asked for its save."""
        if self._validated or (self._epoch_due(trainer) and not self.saves_after_validation(trainer)):
            self._validated = False
            self._save(trainer)

    def on_validation_end(self, trainer: "Trainer") -> None:
        """When `saves_after_validation`, asks for a save after each validation of the fit's
        `every_n_epochs`-th epochs (not the sanity check's, nor `Trainer.validate`'s). The save is made at
        the end of the validation's batch or epoch, the next event, at the same weights: by then every
        callback has taken in this validation (EarlyStop's patience, say), whatever their order, so a
        resume from the save, which does not validate again, goes on as the run did."""
        if (self._training and not trainer.sanity_checking and self._epoch_due(trainer)
                and self.saves_after_validation(trainer)):
            self._validated = True

    def saves_after_validation(self, trainer: "Trainer") -> bool:
        """Where an epoch's save happens: after each of its validations (True), or at its end. With
        `monitor`, after each validation when the fit validates other than once at every epoch's end
        (`val_every_n_steps`, `val_every_n_epochs` > 1), so that each save holds the weights its score
        was measured on, as Lightning's rule does; without, at the epoch's end (one save an epoch)."""
        return self.monitor is not None and not trainer.loops.schedule.each_epoch_end

    def _epoch_due(self, trainer: "Trainer") -> bool:
        return self.every_n_epochs is not None and (trainer.state.epoch + 1) % self.every_n_epochs == 0

    def on_train_end(self, trainer: "Trainer") -> None:
        """With `save_last`, a fit that saved nothing saves now, so that `last` exists (Lightning's rule)."""
        self._training = False
        if self.save_last and not self._saved:
            self._save(trainer, lenient=True)

    def _save(self, trainer: "Trainer", lenient: bool = False) -> None:
        step = trainer.state.global_step
        if step == self._last_saved_step:  # both triggers hit this step, or the run resumed at it
            return
        if self.async_save:
            self._settle(trainer)  # the previous save is committed: link it, delete what it beat
        plan = self._plan(trainer, lenient)
        if plan.name is not None:
            self._config.name_next(candidate_names(plan.name, self.CHECKPOINT_JOIN_CHAR, self.STARTING_VERSION,
                                                   self.FILE_EXTENSION))
        # Set before saving: this callback's state is written into the checkpoint being made.
        self._last_saved_step, self._saving = step, plan
        try:
            self.last_checkpoint = trainer.accelerator.save_state(async_save=self.async_save)
        finally:
            self._saving = None
        self._newest, self._saved = pathlib.Path(self.last_checkpoint).name, True
        if plan.score is not None:
            self._ranking.entries.append((plan.score, self._newest))
        if plan.link is not None:
            self._link.plan(plan.link, self._newest)
        self._publish(trainer)
        if not self.async_save:
            self._settle(trainer)

    def _plan(self, trainer: "Trainer", lenient: bool) -> SavePlan:
        """The save's score, name and link, worked out by the main process and shared: metrics such as
        train_loss differ per process, and only the main process looks at the folder. One broadcast
        per save, and none when there is nothing to work out."""
        if self.monitor is None and self._names == (None, None):
            return SavePlan()
        acc = trainer.accelerator
        mine = None
        if acc.is_main_process:
            # fittrain.lightning's Trainer counts its global_step as Lightning does (every optimizer.step()
            # in manual optimization); its names must say that count.
            mine = plan_save(trainer.state, self._monitor, bool(self._ranking.entries) or lenient, *self._names,
                             self._link, getattr(trainer, "global_step", None), self.monitor_refusal)
        plan = SavePlan(*acc.broadcast(mine and dataclasses.astuple(mine)))
        if plan.error is not None:
            raise ValueError(plan.error)
        return plan

    def _settle(self, trainer: "Trainer") -> None:
        """Once the newest save is committed (waited for): points `last` at it, then deletes what it beat.

        In that order, so that `last` never leads to a deleted folder; the main process does both.
        """
        trainer.accelerator.wait_for_checkpoint()
        main = trainer.accelerator.is_main_process
        if self._link.settle(main) and main and self._config.total_limit is not None:
            self._config.prune()  # the folder `last` led to, kept by the save's own pruning, may go now
        self._delete_beaten(trainer)

    def _publish(self, trainer: "Trainer") -> None:
        """Updates Lightning's attributes, and with `monitor` `trainer.best_checkpoint` and `best_score`."""
        self._update_paths()
        if self._ranking.entries:
            score, name = self._ranking.best()
            trainer.best_checkpoint, trainer.best_score = self._config.checkpoints_dir / name, score

    def _update_paths(self) -> None:
        folder = self._config.checkpoints_dir
        self.last_model_path = str(folder / self._link.name) if self._link.name is not None else ""
        if self._monitor is None:  # Lightning's best without a monitor: the newest save
            self.best_model_path = self.last_checkpoint or ""
            return
        top = self._ranking.top()
        self.best_k_models = {str(folder / name): score for score, name in top}
        self.best_model_path, self.best_model_score = (str(folder / top[0][1]), top[0][0]) if top else ("", None)
        # Lightning's: the worst of the k kept once there are k; keeping every save, the worst so far.
        full = bool(top) and (self.save_top_k is None or len(top) == self.save_top_k)
        self.kth_best_model_path = str(folder / top[-1][1]) if full else ""

    def _delete_beaten(self, trainer: "Trainer") -> None:
        """Deletes (on the main process) the checkpoints neither among the best `save_top_k` nor the newest."""
        beaten = self._ranking.beaten()
        if beaten and trainer.accelerator.is_main_process:
            delete_checkpoints(self._config.checkpoints_dir, beaten)
        self._ranking.forget(beaten)
        if beaten:
            self._update_paths()

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Waits for a checkpoint still being written: after fit, every save is on disk and `last` leads to
        the newest. Then deletes what the last save beat, and with `restore_best` loads the best weights."""
        self._settle(trainer)
        if self.monitor is None:
            return
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
        self._training = self._validated = False
        try:
            trainer.accelerator.wait_for_checkpoint()
        except Exception as err:
            exception.add_note(f"Checkpointer: the checkpoint being written in the background failed too: {err!r}")

    def state_dict(self) -> dict[str, Any]:
        """The last saved step, so a resumed run does not save that step again; the newest save's folder
        name and the `last` link's; with `monitor`, the ranking ([score, name] pairs, JSON-safe),
        including checkpoints still to be deleted."""
        state: dict[str, Any] = {"last_saved_step": self._last_saved_step}
        saving = self._saving
        # Called by save_state while it captures a save, after it reserved the folder (`config.saving`):
        # the checkpoint records itself, so a resume from it knows it is the newest and how it ranks.
        newest = self._config.saving if saving is not None else self._newest
        link = self._link.name if self._link is not None else None
        link = saving.link or link if saving is not None else link
        state.update({key: value for key, value in (("newest", newest), ("last_link", link)) if value is not None})
        if self.monitor is None:
            return state
        entries = list(self._ranking.entries)
        if saving is not None:
            entries.append((saving.score, newest))
        state.update(monitor=self.monitor, mode=self.mode, ranking=encode_ranking(entries))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned; a ranking by another monitor or mode is left out, and so are
        names that are not folders of this Checkpointer's folder (a run started from another's checkpoint)."""
        saved = state.get("last_saved_step")
        self._last_saved_step = None if saved is None else int(saved)
        self._resumed = True
        folder = self._config.checkpoints_dir if self._config is not None else None
        newest, link = (_saved_name(state, key) for key in ("newest", "last_link"))
        if folder is not None and newest is not None and (folder / newest).is_dir():
            self._newest, self.last_checkpoint = newest, str(folder / newest)
        if self._link is not None and link is not None:
            self._link.restore(link)
        if self.monitor is not None and "ranking" in state:
            self._load_ranking(state, folder)
        if folder is not None:
            self._update_paths()

    def _load_ranking(self, state: dict[str, Any], folder: pathlib.Path | None) -> None:
        if (state.get("monitor"), state.get("mode")) != (self.monitor, self.mode):
            warnings.warn(f"Checkpointer: the checkpoint ranked by monitor={state.get('monitor')!r:.80}, "
                          f"mode={state.get('mode')!r:.20}, not monitor={self.monitor!r}, mode={self.mode!r}. Its "
                          "ranking is left out: this run ranks (and deletes) only its own saves.", stacklevel=3)
            return
        entries = decode_ranking(state["ranking"])
        if folder is not None:
            # A new run started from another run's checkpoint: those names are another folder's, and
            # this run's own saves may reuse them. Only folders of this folder are ranked (and deleted).
            entries = [(score, name) for score, name in entries if (folder / name).is_dir()]
        self._ranking.entries = entries

    def __repr__(self) -> str:
        best = "" if self.monitor is None else (f", monitor={self.monitor!r}, mode={self.mode!r}, "
                                                f"save_top_k={self.save_top_k}, restore_best={self.restore_best}")
        named = [(key, value) for key, value, default in (
            ("dirpath", self.dirpath, None), ("filename", self.filename, None), ("save_last", self.save_last, False),
            ("auto_insert_metric_name", self.auto_insert_metric_name, True)) if value != default]
        extra = "".join(f", {key}={value!r}" for key, value in named)
        return (f"Checkpointer(every_n_steps={self.every_n_steps}, every_n_epochs={self.every_n_epochs}, "
                f"total_limit={self.total_limit}, async_save={self.async_save}{best}{extra})")


def _saved_name(state: dict[str, Any], key: str) -> str | None:
    """A folder name from a checkpoint's Checkpointer state; refused unless plain (names are deleted)."""
    name = state.get(key)
    if name is not None and not is_plain_name(name):
        raise CheckpointError(f"The Checkpointer's state in this checkpoint holds a damaged {key!r}: {name!r:.120}. "
                              "It must be one folder name. Resume from another checkpoint.")
    return name
