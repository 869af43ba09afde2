"""Checkpointer: save the whole training state every n optimizer steps and/or every n epochs."""

from __future__ import annotations

import os
import pathlib
import secrets
from typing import TYPE_CHECKING, Any

from fittrain.events import Callback

if TYPE_CHECKING:
    from fittrain.trainer import Trainer


def _check_count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`Checkpointer({name}=...)` must be a positive integer or None. Received: {name}={value!r}.")
    return value


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
    """Saves checkpoints with `accelerator.save_state()` as `{project_dir}/checkpoints/checkpoint_{i}`.

    `i` counts saves. Each folder holds everything a resume needs (model, optimizer, scheduler,
    scaler, RNG, data position, trainer and callback states); `model.safetensors` loads with
    safetensors alone. After a resume, numbering continues after the newest existing folder, so
    nothing is ever overwritten. Every process takes part in a save (it is collective); only the
    main process writes shared files. A step is saved at most once, even when both triggers fire.

    With `async_save=True` a save copies the state to CPU memory and returns; the files are
    written on a background thread while training goes on, and the folder appears when they are
    complete. The next save, a preemption save, the end of fit and an exception wait for it.

    Args:
        every_n_steps: Save after every n-th optimizer step (accumulated batches count once).
        every_n_epochs: Save at the end of every n-th epoch, after its validation.
        total_limit: Keep only the newest this many checkpoints. None keeps the Accelerator's
            setting (unlimited unless configured).
        async_save: Write checkpoints on a background thread; training stalls only while the
            state is copied to CPU memory (a copy that is kept for the next save). See
            `Accelerator.save_state`.

    Raises:
        ValueError: when neither trigger is given, or for a value that is not a positive integer.
        TypeError: when `async_save` is not a bool.

    Example:
        >>> Trainer(callbacks=[Checkpointer(every_n_epochs=1, total_limit=3)]).fit(module, loader)
        >>> Trainer(resume_from="latest").fit(module, loader)  # continues with the next number
        >>> Checkpointer(every_n_steps=500, async_save=True)  # training goes on while it writes
    """

    def __init__(self, every_n_steps: int | None = None, every_n_epochs: int | None = None,
                 total_limit: int | None = None, async_save: bool = False) -> None:
        self.every_n_steps = _check_count("every_n_steps", every_n_steps)
        self.every_n_epochs = _check_count("every_n_epochs", every_n_epochs)
        self.total_limit = _check_count("total_limit", total_limit)
        if every_n_steps is None and every_n_epochs is None:
            raise ValueError("`Checkpointer` needs a trigger: pass every_n_steps=... and/or every_n_epochs=... "
                             "Received: every_n_steps=None, every_n_epochs=None.")
        if not isinstance(async_save, bool):
            raise TypeError(f"`Checkpointer(async_save=...)` must be True or False. Received: "
                            f"async_save={async_save!r} (type {type(async_save).__name__}). "
                            "Pass async_save=True to write checkpoints in the background.")
        self.async_save = async_save
        self.last_checkpoint: str | None = None
        self._seen_step = 0
        self._last_saved_step: int | None = None

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
        _check_writable(config.checkpoints_dir)  # every process writes files there

    def on_train_epoch_start(self, trainer: "Trainer") -> None:
        """Notes the current step: a resumed run starts at its checkpoint's step, which is no new step."""
        self._seen_step = trainer.state.global_step

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
        # Set before saving: this callback's state is written into the checkpoint being made.
        self._last_saved_step = step
        self.last_checkpoint = trainer.accelerator.save_state(async_save=self.async_save)

    def on_fit_end(self, trainer: "Trainer") -> None:
        """Waits for a checkpoint still being written: after fit, every save is on disk."""
        trainer.accelerator.wait_for_checkpoint()

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        """Waits for a checkpoint still being written, so it is complete before the process may exit.

        A failure of that write is added to `exception` as a note; the original stays the error raised.
        """
        try:
            trainer.accelerator.wait_for_checkpoint()
        except Exception as err:
            exception.add_note(f"Checkpointer: the checkpoint being written in the background failed too: {err!r}")

    def state_dict(self) -> dict[str, Any]:
        """The last saved step, so a resumed run does not save that step again."""
        return {"last_saved_step": self._last_saved_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned."""
        saved = state.get("last_saved_step")
        self._last_saved_step = None if saved is None else int(saved)

    def __repr__(self) -> str:
        return (f"Checkpointer(every_n_steps={self.every_n_steps}, every_n_epochs={self.every_n_epochs}, "
                f"total_limit={self.total_limit}, async_save={self.async_save})")
