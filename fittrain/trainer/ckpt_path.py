"""`validate/test/predict(ckpt_path=...)`: which checkpoint's weights to evaluate, as in Lightning.

`ckpt_path` is "best" (the Checkpointer's best checkpoint of this fit), "last" (its newest), a
checkpoint folder, or None (the module as it is).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


def restore_for_evaluation(trainer: "Trainer", ckpt_path: str | os.PathLike | None, method: str) -> None:
    """Loads the weights `ckpt_path` names into `trainer.model` before `method` ("validate", "test",
    "predict") runs; None leaves the module as it is."""
    if ckpt_path is None:
        return
    raise NotImplementedError(f"Trainer.{method}(ckpt_path=...) is not implemented yet.")
