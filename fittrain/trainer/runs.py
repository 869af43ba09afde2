"""The Trainer's run: its name, its checkpoint folder, and the checkpoint a resume loads.

Each fit is one run, `{project_dir}/checkpoints/{run_name}/checkpoint_{i}` beside the Logger's
`{project_dir}/logs/{run_name}/`. A fresh fit takes a new name (free in both folders), or the
name given (`Trainer(run_name=...)` or `Logger(run_name=...)`), whose folder must hold no
checkpoint: a fresh fit never writes into, prunes or ranks another run's folder. A resumed fit
continues the run that holds its checkpoint, numbering and pruning in that folder; a checkpoint
from elsewhere (another project, a plain `save_state` folder) starts a new run from its state.
`resume_from="auto"` is "latest" where something was saved, and a fresh run where nothing was:
the same command serves a job's first launch and its requeues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pathlib
from typing import TYPE_CHECKING, Any, Callable, Sequence

from fittrain.checkpoint.fastio import MANIFEST_NAME
from fittrain.checkpoint.latest import latest_checkpoint, latest_run_checkpoint, load_newest
from fittrain.checkpoint.naming import CHECKPOINTS_DIR
from fittrain.checkpoint.run_folders import RUN_FILE, holds_checkpoints, read_saves, run_folders, saved_by
from fittrain.common.reprs import short_repr
from fittrain.trackers.runs import new_run_name
from fittrain.trainer.events import Callback, RunRequest
from fittrain.trainer.parts import warn_once

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

#: `resume_from`'s value for "resume if something was saved, else start afresh".
AUTO = "auto"


@dataclasses.dataclass
class RunPlan:
    """What a fit does with runs.

    Attributes:
        name: The run's name: its folder under `checkpoints/` and under `logs/`.
        checkpoint: The checkpoint to resume from, or None for a fresh start.
        newest: Load the newest loadable checkpoint of `checkpoint`'s folder instead (for "latest"
            and a run folder given): a damaged one is passed over for the next older.
        continues: The checkpoint belongs to this run: its numbering and ranking go on.
        fresh_note: For `resume_from="auto"` with nothing saved: the line that says the fit starts afresh.
    """

    name: str
    checkpoint: pathlib.Path | None = None
    newest: bool = False
    continues: bool = False
    fresh_note: str | None = None


def start_run(trainer: "Trainer", run_name: str | None, warn: Callable[[str], None]) -> RunPlan:
    """Plans the fit's run (`plan_run`) and points the Accelerator's automatic naming at its folder.

    Args:
        trainer: The Trainer starting a fit.
        run_name: The name its `run_name` argument gave, or None.
        warn: Called with the warning for each damaged checkpoint passed over.
    """
    acc = trainer.accelerator
    config = acc.project_configuration
    # Where Checkpointer and preemption save: the Accelerator's project_dir, else the Trainer's.
    root = pathlib.Path(config.project_dir or trainer.project_dir) / CHECKPOINTS_DIR
    requests = trainer.events.run_requests()
    given = given_run_name(run_name, requests)
    logs = logs_folders(requests, config.logging_dir, trainer.project_dir)
    folder = checkpoint_folder(requests)

    def new_name() -> str:  # the main process's choice on every process (the clock differs by rank)
        return acc.broadcast(_not_saving_in(new_run_name(root, *logs), folder))

    plan = plan_run(trainer.resume_from, given, root, trainer.project_dir, new_name, warn, folder)
    config.use_run(plan.name)
    return plan


def load_resumed(trainer: "Trainer", plan: RunPlan) -> None:
    """Loads the checkpoint `plan` resumes from into the prepared Trainer, and says so in one line;
    with none, says so too where `resume_from="auto"` found nothing to resume.

    With `plan.newest`, the newest checkpoint of the run that loads: one whose files are refused only
    when parsed (a planted pickle, garbled contents) is passed over like one that fails its checksums.
    """
    acc, state = trainer.accelerator, trainer.state
    if plan.checkpoint is None:
        if plan.fresh_note is not None:
            acc.print(plan.fresh_note)
        return
    if plan.newest:
        loaded = load_newest(plan.checkpoint.parent, lambda msg: warn_once(trainer, msg), acc.load_state)
    else:
        loaded = acc.load_state(plan.checkpoint)
    if not plan.continues:  # a checkpoint from elsewhere: this new run numbers its own saves from 0
        acc.project_configuration.iteration = 0
    position = trainer.train_loader.position
    # A checkpoint saved at epoch end already finished that epoch: its loader moved on.
    state.epoch = max(state.epoch, position.epoch)
    # One line, so that a run resumed from the wrong checkpoint (a smoke run's) is noticed.
    acc.print(f"Resumed from {loaded}: epoch {state.epoch}, optimizer step {state.global_step}, "
              f"{position.batches_consumed} batches into the epoch.")


def describe_run(trainer: "Trainer") -> str:
    """One line: the run that trains, where its checkpoints and logs go (or that none are written)."""
    if trainer.limits.dev_run:  # its line said so: the callbacks that would write are muted
        return f"Training run {trainer.run_name!r} in fast_dev_run mode: no checkpoints, no logs."
    requests = [request for _, request in trainer.events.run_requests()]
    config = trainer.accelerator.project_configuration
    if any(request.saves_checkpoints for request in requests):
        saved = f"checkpoints in {config.checkpoints_dir}"
    else:
        saved = "no checkpoints (add fittrain.callbacks.Checkpointer to save them)"
    writers = [request for request in requests if request.writes_logs]
    if writers:  # where the Logger writes: its log_dir, else the Accelerator's logging_dir, else {project}/logs
        folder = writers[0].log_dir or config.logging_dir or os.path.join(trainer.project_dir, "logs")
        logs = f"logs in {os.path.join(folder, trainer.run_name)}"
    else:
        logs = "no logs (add fittrain.callbacks.Logger to write them)"
    return f"Training run {trainer.run_name!r}: {saved}; {logs}."


def given_run_name(trainer_name: str | None,
                   requests: Sequence[tuple[Callback, RunRequest]]) -> tuple[str | None, str]:
    """The run name given by `Trainer(run_name=...)` or a callback's (a Logger's `run_name`), and which
    argument gave it.

    Args:
        trainer_name: The Trainer's `run_name`.
        requests: Each callback with its `run_request()`.

    Raises:
        ValueError: when two of them name different runs.
    """
    named = [("Trainer(run_name=...)", trainer_name)] if trainer_name is not None else []
    named += [(f"{type(cb).__name__}(run_name=...)", request.name) for cb, request in requests
              if request.name is not None]
    if len({name for _, name in named}) > 1:
        listed = ", ".join(f"{source[:-4]}{name!r})" for source, name in named)
        raise ValueError(f"The run is named twice, differently: {listed}. A run's logs and checkpoints carry one "
                         "name: pass it once (Trainer(run_name=...)), or the same name to each.")
    return (named[0][1], named[0][0]) if named else (None, "")


def plan_run(resume_from: Any, given: tuple[str | None, str], root: pathlib.Path, project_dir: str,
             new_name: Callable[[], str], warn: Callable[[str], None], folder: pathlib.Path | None = None) -> RunPlan:
    """Decides the run's name and the checkpoint it resumes from.

    Args:
        resume_from: The Trainer's argument: None, "latest", "auto", a checkpoint folder or a run folder.
        given: (name, source) from `given_run_name`.
        root: `{project_dir}/checkpoints`, which holds the run folders.
        project_dir: The Trainer's, against which a relative `resume_from` is also looked up.
        new_name: Returns a fresh run name (the same on every process).
        warn: Called with the warning for each damaged checkpoint passed over.
        folder: Where checkpoints are saved instead of run folders (a Checkpointer's `dirpath`): "latest"
            is its newest save, and a checkpoint there continues the run that saved it (its saves.json).

    Raises:
        FileNotFoundError: for a missing `resume_from` folder, "latest" without a checkpoint, or "auto"
            where checkpoints were saved but none is intact.
        ValueError: for a fresh run whose given name's folder holds checkpoints already.
    """
    name, source = given
    plan = _find_checkpoint(resume_from, root, project_dir, name, warn, folder)
    owner = _owning_run(plan.checkpoint, root, folder)
    plan.continues = owner is not None and (name is None or owner == name)
    plan.name = name or owner or new_name()
    in_folder = folder is not None and plan.name in _runs_saving_in(folder)  # a run's saves in a shared dirpath
    if not plan.continues and (in_folder or holds_checkpoints(root / plan.name)):
        taken = folder if in_folder else root / plan.name
        started = "A fresh fit" if plan.checkpoint is None else f"A fit resuming from {str(plan.checkpoint)!r}"
        raise ValueError(
            f"`{source}` names a run whose checkpoints exist already ({str(taken)!r}). Received: "
            f"run_name={plan.name!r}. {started} never writes into another run's folder. Pass "
            "resume_from='latest' to continue that run, or another run_name (or none: a new name is chosen).")
    return plan


def logs_folders(requests: Sequence[tuple[Callback, RunRequest]], logging_dir: str | None,
                 project_dir: str) -> list[str]:
    """The folders where this fit's run may write logs (the callbacks' `log_dir`s too): a fresh name
    must be free in each."""
    folders = [logging_dir or os.path.join(project_dir, "logs")]
    return folders + [request.log_dir for _, request in requests if request.log_dir]


def check_one_checkpointer(callbacks: Sequence[Callback]) -> None:
    """Refuses two callbacks that save checkpoints (`RunRequest.saves_checkpoints`, such as two
    Checkpointers): both would save after the same steps, numbering the same folders."""
    found = [cb for cb in callbacks if cb.run_request().saves_checkpoints]
    if len(found) > 1:
        kinds = " and ".join(sorted({type(cb).__name__ for cb in found}))
        raise ValueError(
            f"`callbacks` holds {len(found)} {kinds}s ({', '.join(short_repr(cb, 120) for cb in found)}); each "
            "would save into the same checkpoints folder, two saves per step. Use one Checkpointer: it takes "
            "every_n_steps and every_n_epochs together.")


def run_hparams(trainer: "Trainer", extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a run was given, for trackers: the Trainer's arguments, the module's `hparams` dict (if it
    has one), then `extra` (a Logger's `hparams`), later ones winning on equal names."""
    acc = trainer.accelerator
    values: dict[str, Any] = {
        "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
        "gradient_accumulation_steps": acc.gradient_accumulation_steps,
        "val_every_n_epochs": trainer.val_every_n_epochs, "val_every_n_steps": trainer.val_every_n_steps,
        "strategy": acc.strategy, "precision": acc.mixed_precision, "num_processes": acc.num_processes,
        "callbacks": ", ".join(short_repr(cb, 200) for cb in trainer.events.callbacks),
    }
    optimizers = trainer.optimizers or [trainer.optimizer]
    values["optimizer"] = ", ".join(type(getattr(o, "optimizer", o)).__name__ for o in optimizers if o is not None)
    module_hparams = trainer.module.recordable_hparams() if trainer.module is not None else None
    values.update(module_hparams or {})
    values.update(extra or {})
    return values


def checkpoint_folder(requests: Sequence[tuple[Callback, RunRequest]]) -> pathlib.Path | None:
    """Where the callback that saves checkpoints saves them instead of the run's folder: its `dirpath`
    attribute (the Checkpointer's, and Lightning's ModelCheckpoint's, name), or None."""
    dirpath = next((getattr(cb, "dirpath", None) for cb, request in requests if request.saves_checkpoints), None)
    return None if dirpath is None else pathlib.Path(dirpath)


def _runs_saving_in(folder: pathlib.Path) -> set[str | None]:
    """The runs that saved checkpoints into `folder` (a dirpath several runs may share), as its saves.json says."""
    return {run for _, run in read_saves(folder)}


def _not_saving_in(name: str, folder: pathlib.Path | None) -> str:
    """`name`, or `name-2`, `name-3`, ...: a new run's name under which no checkpoint in `folder` was saved
    (a run's name tells its saves there from another run's, which it never deletes)."""
    taken = _runs_saving_in(folder) if folder is not None else set()
    candidates = itertools.chain([name], (f"{name}-{i}" for i in itertools.count(2)))
    return next(candidate for candidate in candidates if candidate not in taken)


def _find_checkpoint(resume_from: Any, root: pathlib.Path, project_dir: str, name: str | None,
                     warn: Callable[[str], None], folder: pathlib.Path | None) -> RunPlan:
    if resume_from is None:
        return RunPlan(name="")
    if str(resume_from) == AUTO:
        return _auto_checkpoint(root, project_dir, name, warn, folder)
    if str(resume_from) == "latest" and folder is not None:  # a Checkpointer's dirpath: its newest save
        return RunPlan(name="", checkpoint=latest_checkpoint(folder, warn), newest=True)
    if str(resume_from) == "latest":
        # With a run name given, "latest" is that run's newest checkpoint; else the latest started run's.
        found = latest_checkpoint(root / name, warn) if name else latest_run_checkpoint(root, warn)
        return RunPlan(name="", checkpoint=found, newest=True)
    for candidate in (pathlib.Path(resume_from), pathlib.Path(project_dir) / resume_from):
        if candidate.is_symlink():  # a Checkpointer's `last`: the checkpoint it leads to
            candidate = candidate.resolve()
        if candidate.is_dir():
            if _is_run_folder(candidate):  # a run folder: its newest intact checkpoint
                return RunPlan(name="", checkpoint=latest_checkpoint(candidate, warn), newest=True)
            return RunPlan(name="", checkpoint=candidate)
    received = short_repr(os.fspath(resume_from), 400)
    raise FileNotFoundError(
        f"`resume_from` names a folder that does not exist. Received: resume_from={received}. Pass an existing "
        "checkpoint folder such as 'checkpoints/run_a/checkpoint_3', a run folder such as 'checkpoints/run_a' (its "
        "newest checkpoint), or 'latest'.")


def _auto_checkpoint(root: pathlib.Path, project_dir: str, name: str | None, warn: Callable[[str], None],
                     folder: pathlib.Path | None) -> RunPlan:
    """`resume_from="auto"`: "latest" where the run (or the project) saved a checkpoint, else a fresh start.

    Raises:
        FileNotFoundError: when checkpoints were saved but none is intact: starting afresh would
            silently throw that training away.
    """
    searched = folder if folder is not None else root / name if name else root
    try:
        return _find_checkpoint("latest", root, project_dir, name, warn, folder)
    except FileNotFoundError as missing:
        saved = holds_checkpoints(searched) or (searched == root and any(map(holds_checkpoints, run_folders(root))))
        if saved:
            raise FileNotFoundError(
                f"resume_from='auto' found checkpoints under {str(searched)!r}, but none that can be resumed, so "
                f"it does not start afresh over them. Received: resume_from='auto'. Detail: {missing} Pass "
                "resume_from=<a checkpoint folder> to choose one, or move the folder away to start afresh.") from None
    return RunPlan(name="", fresh_note=f"resume_from='auto': nothing saved under {str(searched)!r} yet, so this fit "
                                       "starts a new run.")


def _is_run_folder(folder: pathlib.Path) -> bool:
    """A folder of checkpoints rather than a checkpoint (which has a manifest, or is incomplete)."""
    return not (folder / MANIFEST_NAME).exists() and ((folder / RUN_FILE).exists() or holds_checkpoints(folder))


def _owning_run(checkpoint: pathlib.Path | None, root: pathlib.Path, folder: pathlib.Path | None) -> str | None:
    """The name of the run folder under `root` that holds `checkpoint`, or the run that saved it into
    `folder` (its saves.json says); None (elsewhere)."""
    if checkpoint is None:
        return None
    with contextlib.suppress(OSError):
        if folder is not None and os.path.samefile(checkpoint.parent, folder):
            return saved_by(folder, checkpoint.name)
    try:
        inside = os.path.samefile(checkpoint.parent.parent, root)
    except OSError:
        return None
    return checkpoint.parent.name if inside else None
