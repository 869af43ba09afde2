"""Trainer.fit on streams, one process: runs to max_steps over passes without a length, validates
every N steps, and an interrupted run ends bitwise-identical to an uninterrupted one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer, Logger
from stream_data import Numbers, Regressor, StatefulNumbers, fit, hugging_face, interrupted_fit


def _torchdata(workers: int) -> DataLoader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(hugging_face(37, shards=4, buffer_size=5), batch_size=4, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("make", [
    lambda w: DataLoader(hugging_face(37, shards=4, buffer_size=5), batch_size=4, num_workers=w),
    lambda w: DataLoader(StatefulNumbers(37), batch_size=4, num_workers=w),
    lambda w: DataLoader(Numbers(37), batch_size=4, num_workers=w),
    _torchdata,
], ids=["hugging_face_shuffled", "stateful", "stateless", "stateful_dataloader"])
def test_an_interrupted_run_ends_bitwise_identical(make, workers: int, tmp_path) -> None:
    # 37 samples in batches of 4: 10 batches a pass, so 23 steps cross two pass ends, and the
    # interruption at step 13 falls mid-pass.
    loader = lambda: make(workers)  # noqa: E731
    full = fit(loader, tmp_path / "full", 23)
    resumed = interrupted_fit(loader, tmp_path / "resumed", 13, 23)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key


def test_resuming_a_stream_without_state_warns_with_the_batches_it_reads_again(tmp_path) -> None:
    loader = lambda: DataLoader(Numbers(37), batch_size=4)  # noqa: E731
    fit(loader, tmp_path, 3, every_n_steps=3)
    trainer = Trainer(max_steps=5, project_dir=tmp_path, resume_from="latest")
    with pytest.warns(UserWarning, match=r"a stream without state_dict\(\)/load_state_dict\(\).*the 3 batches"):
        trainer.fit(Regressor(), loader())


class _Validations(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: Trainer) -> None:
        self.steps.append(trainer.state.global_step)


class _Validated(Regressor):
    def validation_step(self, batch):
        return self.training_step(batch)


def test_a_stream_trains_to_max_steps_validating_every_n_steps(tmp_path) -> None:
    seen = _Validations()
    trainer = Trainer(max_steps=25, val_every_n_steps=10, project_dir=tmp_path,
                      callbacks=[seen, Logger(every_n_steps=5), Checkpointer(every_n_steps=10)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing about a missing length
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        trainer.fit(_Validated(), DataLoader(Numbers(37), batch_size=4), DataLoader(Numbers(9), batch_size=4))
    assert trainer.state.global_step == 25
    assert seen.steps == [10, 20]
    assert trainer.state.epoch == 3  # passes of 10 batches: the third ended early, at max_steps
    assert "val_loss" in trainer.state.metrics
