"""What fit does when preempted: after the optimizer step in flight, save a checkpoint and exit 75.

`Trainer(preemption_signals=...)` names the signals (fittrain/distributed/preemption.py records
them); the loop checks for one after each optimizer step and calls `save_and_exit` there, so the
checkpoint holds a finished step and `resume_from="latest"` continues exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE
from fittrain.trainer.parts import warn_once

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


def save_and_exit(trainer: "Trainer") -> NoReturn:
    """Saves the preemption checkpoint on every process, says where, and exits with 75
    (`PREEMPTION_EXIT_CODE`), requeueing the job first under SLURM when asked (SIGUSR1)."""
    try:
        trainer.accelerator.wait_for_checkpoint()
    except Exception as err:
        # The preemption save matters more than an earlier one that failed: report it and save.
        warn_once(trainer, f"A background checkpoint write had failed; saving the preemption checkpoint "
                           f"anyway. The failure: {err!r}")
    # A user's Accelerator may lack automatic naming; "latest" must find this checkpoint.
    config = trainer.accelerator.project_configuration
    config.automatic_checkpoint_naming = True
    if config.project_dir is None:
        config.set_directories(trainer.project_dir)
    path = trainer.accelerator.save_state()
    # Every rank exits 75: none leaves before all have saved (torchrun stops the others with
    # SIGTERM as soon as one exits), and that SIGTERM then finds the signal ignored.
    trainer.accelerator.wait_for_everyone()
    trainer.preemption.mark_exiting(trainer.accelerator.use_distributed)
    trainer.accelerator.print(f"Preempted: saved {path}; resume with resume_from='latest'.")
    trainer.preemption.requeue_if_asked(trainer.accelerator.is_main_process)  # SIGUSR1 under SLURM only
    raise SystemExit(PREEMPTION_EXIT_CODE)
