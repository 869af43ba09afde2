"""The built-in callbacks ignore the sanity check's validation (Trainer(num_sanity_val_steps=...)), as
Lightning's do: EarlyStop does not count it as a check, and the Logger writes none of its metrics."""

from __future__ import annotations

import pathlib
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fittrain import Trainer
from fittrain.callbacks import EarlyStop, Logger
from support.models import Regressor, regression_loader


class Scripted(Regressor):
    """Logs val_score 0.0 during the sanity check (the best value a check could see), then 1.0, 2.0, ..."""

    def validation_step(self, batch: Any) -> None:
        trainer = self.trainer
        self.log("val_score", 0.0 if trainer.sanity_checking else float(trainer.state.epoch + 1))


def test_early_stop_and_logger_ignore_the_sanity_check(tmp_path: pathlib.Path) -> None:
    early = EarlyStop(monitor="val_score", mode="min", patience=1)
    trainer = Trainer(max_epochs=4, num_sanity_val_steps=2, project_dir=tmp_path, enable_progress_bar=False,
                      callbacks=[early, Logger(every_n_steps=1, progress_bar=False)])
    trainer.fit(Scripted(), regression_loader(), regression_loader())
    # Counted, the sanity check's 0.0 would be the best and epoch 0's 1.0 would already stop training.
    # Ignored, epoch 0 sets the best (1.0) and epoch 1 (2.0) is the one worse check patience allows.
    assert early.stopped_epoch == 1
    assert trainer.state.epoch == 2
    (run,) = (tmp_path / "logs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.value for e in events.Scalars("val_score")] == [1.0, 2.0]
