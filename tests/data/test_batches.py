"""Lists of ready batches as a data source (fittrain/data/batches.py), alone and under Trainer.fit.

Sharding is checked on one process by building `BatchesShard` for each rank, as tests/data/test_data.py
does for DataLoaders: the rank arithmetic is the same as in a real group. A real 2-process run is
in tests/trainer/test_trainer_ddp.py. Expected orders are written out by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.data import BatchesShard
from fittrain.distributed.gradient_state import GradientState
from support.models import regression_data


def shard(batches: Any, world: int = 1, rank: int = 0, even: bool = True) -> BatchesShard:
    return BatchesShard(batches, None, GradientState(), world, rank, even)


def test_one_process_yields_the_batches_themselves_in_order_every_epoch():
    batches = [torch.tensor([i]) for i in range(5)]
    source = shard(batches)
    for epoch in range(2):
        seen = list(source)
        assert len(seen) == len(source) == 5
        assert all(a is b for a, b in zip(seen, batches))  # not copied, not moved
        assert source.position.epoch == epoch + 1 and source.position.batches_consumed == 0


def test_end_of_dataloader_marks_the_last_batch_only():
    state = GradientState()
    source = BatchesShard(list(range(3)), None, state)
    flags = [state.end_of_dataloader for _ in source.iterate(skip=0)]
    assert flags == [False, False, True]
    assert state.end_of_dataloader is False  # the pass is over


@pytest.mark.parametrize("even, expected", [
    (True, {0: [0, 3, 6], 1: [1, 4, 0], 2: [2, 5, 1]}),   # 7 batches on 3 ranks: the last round is padded
    (False, {0: [0, 3, 6], 1: [1, 4], 2: [2, 5]}),        # evaluation: every batch exactly once
])
def test_ranks_take_every_nth_batch(even, expected):
    for rank, want in expected.items():
        source = shard(list(range(7)), world=3, rank=rank, even=even)
        assert list(source) == want and len(source) == len(want)


def test_skip_continues_mid_epoch_and_state_round_trips():
    source = shard(list(range(6)), world=2, rank=1)
    it = source.iterate(skip=0)
    assert [next(it), next(it)] == [1, 3]
    saved = source.state_dict()
    assert saved == {"seed": 0, "epoch": 0, "batches_consumed": 2, "start_items": 0, "start_batch": 0,
                     "num_processes": 2, "order_consumed": 4}  # both ranks took 2 of the 6 batches
    resumed = shard(list(range(6)), world=2, rank=1)
    resumed.load_state_dict(saved)
    assert list(resumed.iterate(skip=resumed.position.batches_consumed)) == [5]
    assert resumed.position.epoch == 1


def test_prepare_data_loader_takes_a_list_and_prepare_passes_it_through():
    accelerator = Accelerator(cpu=True)
    batches = [torch.zeros(2), torch.ones(2)]
    assert accelerator.prepare(batches) is batches  # as in Accelerate: unknown objects pass through
    prepared = accelerator.prepare_data_loader(batches)
    assert isinstance(prepared, BatchesShard) and accelerator.prepare_data_loader(prepared) is prepared
    assert [b.tolist() for b in accelerator.skip_first_batches(prepared, 1)] == [[1.0, 1.0]]


class Regressor(TrainModule):
    """An MLP under SGD with momentum: a resume that lost the optimizer's state would not end exactly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        return self.training_step(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def as_list(dataset: TensorDataset, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = dataset.tensors
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def test_fit_on_a_list_matches_fit_on_an_unshuffled_dataloader(tmp_path):
    on_list, on_loader = Regressor(), Regressor()
    listed = Trainer(max_epochs=2, gradient_accumulation_steps=2, project_dir=tmp_path / "a")
    listed.fit(on_list, as_list(regression_data(40, seed=1), 8), as_list(regression_data(40, seed=1), 16))
    loaded = Trainer(max_epochs=2, gradient_accumulation_steps=2, project_dir=tmp_path / "b")
    loaded.fit(on_loader, DataLoader(regression_data(40, seed=1), batch_size=8),
               DataLoader(regression_data(40, seed=1), batch_size=16))
    for (name, a), b in zip(on_list.state_dict().items(), on_loader.state_dict().values()):
        assert torch.equal(a, b), name
    assert listed.state.global_step == loaded.state.global_step == 6
    assert listed.state.metrics["val_loss"] == loaded.state.metrics["val_loss"]


def test_resume_mid_epoch_on_a_list_is_exact(tmp_path):
    batches = as_list(regression_data(40, seed=1), 8)  # 5 batches an epoch
    full = Regressor()
    uninterrupted = Trainer(max_steps=8, project_dir=tmp_path / "full")
    uninterrupted.fit(full, batches)
    first = Trainer(max_steps=3, project_dir=tmp_path / "cut", callbacks=[Checkpointer(every_n_steps=3)])
    first.fit(Regressor(), batches)
    resumed = Regressor()
    second = Trainer(max_steps=8, project_dir=tmp_path / "cut", resume_from="latest")
    second.fit(resumed, batches)
    assert second.state.state_dict() == uninterrupted.state.state_dict()
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("argument", ["train_loader", "val_loader"])
def test_one_shot_iterators_and_unsized_iterables_are_refused_by_name(tmp_path, argument):
    batches = as_list(regression_data(40, seed=1), 8)

    class Unsized:
        def __iter__(self):
            return iter(batches)

    for bad, match in (((b for b in batches), "one-shot iterator \\(generator\\)"),
                       (Unsized(), "Unsized, which has no len")):
        loaders = {"train_loader": batches, "val_loader": batches, argument: bad}
        with pytest.raises(TypeError, match=f"`{argument}` must be a DataLoader or a .*{match}"):
            Trainer(project_dir=tmp_path).fit(Regressor(), **loaders)


def test_an_empty_list_is_refused_like_an_empty_loader(tmp_path):
    with pytest.raises(ValueError, match="empty train_loader"):
        Trainer(project_dir=tmp_path).fit(Regressor(), [])


def test_validate_and_prepare_data_loader_name_their_own_argument(tmp_path):
    one_shot = (b for b in as_list(regression_data(40, seed=1), 8))
    with pytest.raises(TypeError, match="`loader` must be a DataLoader or a .*generator"):
        Trainer(project_dir=tmp_path).validate(Regressor(), one_shot)
    with pytest.raises(TypeError, match="`data_loader` must be a DataLoader or a .*generator"):
        Accelerator(cpu=True).prepare_data_loader(one_shot)
