"""Every map-style loader users bring, in their own order: batch_size=None, custom batch
samplers, samplers, generators and torchdata's StatefulDataLoader (fittrain/data/order.py,
dealing.py, map_style.py).

Expectations come from plain PyTorch: the same DataLoader iterated unprepared from the same RNG
state, and the global RNG state it leaves behind. Dealing to ranks is checked on one process by
building `DataLoaderShard` for each rank (tests/data/test_data_ranks.py runs real ranks).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, WeightedRandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from fittrain import Accelerator, CheckpointError, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.data import DataLoaderShard
from fittrain.distributed.gradient_state import GradientState


class Samples(Dataset):
    """Sample i is tensor(i); records what was loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded.append(index)
        return torch.tensor(index)


class ReadyBatches(Dataset):
    """Key k is a whole batch of 1 to 3 samples (a NumPy array, which collate turns into a tensor)."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int) -> np.ndarray:
        self.loaded.append(key)
        return np.arange(10 * key, 10 * key + 1 + key % 3)


class NoisyBatches(ReadyBatches):
    """Ready batches with noise from torch's global RNG, like augmentation."""

    def __getitem__(self, key: int) -> torch.Tensor:
        return torch.as_tensor(super().__getitem__(key), dtype=torch.float32) + torch.rand(())


class RandomBuckets(Sampler):
    """A batch sampler that shuffles with the global RNG and yields batches of 3, 1, 2, 3, ... indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _cuts(self):
        start, k = 0, 0
        while start < self.n:
            size = [3, 1, 2][k % 3]
            yield start, size
            start, k = start + size, k + 1

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        for start, size in self._cuts():
            yield order[start:start + size]

    def __len__(self) -> int:
        return len(list(self._cuts()))


class EagerSampler(Sampler):
    """Draws its whole order when iter() is called (not a generator function)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class CyclingSampler(Sampler):
    """A sampler with its own state (state_dict): each pass rotates the order one step further."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __iter__(self):
        self.passes += 1
        shift = 3 * self.passes + int(torch.randint(0, self.n, ()))
        yield from [(i + shift) % self.n for i in range(self.n)]

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"]


def _loaders(workers: int) -> dict[str, Callable[[], DataLoader]]:
    w = dict(num_workers=workers)
    return {
        "shuffle": lambda: DataLoader(Samples(14), batch_size=4, shuffle=True, **w),
        "generator": lambda: DataLoader(Samples(14), batch_size=4, shuffle=True,
                                        generator=torch.Generator().manual_seed(5), **w),
        "weighted": lambda: DataLoader(Samples(9), batch_size=3, sampler=WeightedRandomSampler(
            torch.linspace(0.1, 1, 9), 10), **w),
        "eager_sampler": lambda: DataLoader(Samples(10), batch_size=3, sampler=EagerSampler(10), **w),
        "batch_sampler": lambda: DataLoader(Samples(13), batch_sampler=RandomBuckets(13), **w),
        "batch_size_none": lambda: DataLoader(ReadyBatches(7), batch_size=None, shuffle=True, **w),
        "stateful_sampler": lambda: DataLoader(Samples(11), batch_size=4, sampler=CyclingSampler(11), **w),
        "stateful_dataloader": lambda: StatefulDataLoader(Samples(14), batch_size=4, shuffle=True, **w),
    }


KINDS = list(_loaders(0))


def as_lists(loader: Any) -> list[list[int]]:
    return [b.tolist() for b in loader]


def plain_epochs(make: Callable[[], DataLoader], seed: int, epochs: int = 2) -> tuple[list, torch.Tensor]:
    """What the unprepared loader yields from `seed`, and the global RNG state it leaves."""
    torch.manual_seed(seed)
    loader = make()
    got = [as_lists(loader) for _ in range(epochs)]
    return got, torch.get_rng_state()


def prepared_epochs(make: Callable[[], DataLoader], seed: int, epochs: int = 2) -> tuple[list, torch.Tensor]:
    torch.manual_seed(seed)
    loader = Accelerator(cpu=True).prepare(make())
    assert isinstance(loader, DataLoaderShard)
    got = [as_lists(loader) for _ in range(epochs)]
    return got, torch.get_rng_state()


# ------------------------------------------------------------------ the same order as plain PyTorch
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_one_process_yields_the_plain_loaders_batches_and_leaves_the_global_rng_where_it_does(kind, workers):
    make = _loaders(workers)[kind]
    want, rng_after_plain = plain_epochs(make, seed=3)
    got, rng_after_prepared = prepared_epochs(make, seed=3)
    assert got == want
    assert want[0] != want[1]  # every kind here draws a new order each epoch
    assert torch.equal(rng_after_prepared, rng_after_plain)


def test_persistent_workers_draw_the_base_seed_once_as_torch_does():
    def make() -> DataLoader:
        return DataLoader(Samples(12), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    want, rng_after_plain = plain_epochs(make, seed=4, epochs=3)
    got, rng_after_prepared = prepared_epochs(make, seed=4, epochs=3)
    assert got == want
    assert torch.equal(rng_after_prepared, rng_after_plain)


def test_the_order_is_drawn_when_iteration_starts_as_in_torch():
    # Global RNG use between building the loader and iterating it (model init, dropout) moves
    # the order of a plain loader, and moves the prepared one's the same way.
    torch.manual_seed(6)
    plain = DataLoader(Samples(16), batch_size=4, shuffle=True)
    torch.rand(7)
    want = as_lists(plain)
    torch.manual_seed(6)
    prepared = Accelerator(cpu=True).prepare(DataLoader(Samples(16), batch_size=4, shuffle=True))
    torch.rand(7)
    assert as_lists(prepared) == want


def test_batch_size_none_applies_collate_fn_to_each_ready_batch():
    seen = []

    def collate(item: np.ndarray) -> torch.Tensor:
        seen.append(type(item))
        return torch.as_tensor(item) * 2

    loader = DataLoader(ReadyBatches(4), batch_size=None, collate_fn=collate)
    assert as_lists(Accelerator(cpu=True).prepare(loader)) == [[0], [20, 22], [40, 42, 44], [60]]
    assert seen == [np.ndarray] * 4


def test_ready_batches_get_the_same_worker_randomness_at_any_worker_count_and_after_a_skip():
    def run(num_workers: int, skip: int = 0) -> list[torch.Tensor]:
        torch.manual_seed(8)
        loader = Accelerator(cpu=True).prepare(
            DataLoader(NoisyBatches(6), batch_size=None, shuffle=True, num_workers=num_workers))
        return list(loader.iterate(skip=skip))

    full, again, resumed = run(1), run(2), run(2, skip=2)
    assert len(full) == len(again) == 6 and len(resumed) == 4
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    assert all(torch.equal(a, b) for a, b in zip(full[2:], resumed))
    assert len({float(b[0] - b[0].floor()) for b in full}) == 6  # each batch has noise of its own


# ------------------------------------------------------------------ exact resume
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffle", "generator", "batch_sampler", "batch_size_none", "stateful_sampler",
                                  "stateful_dataloader", "eager_sampler"])
def test_save_state_mid_epoch_then_skip_first_batches_continues_exactly(tmp_path, kind, workers):
    check_exact_resume(tmp_path, _loaders(workers)[kind], keys=kind == "batch_size_none", workers=workers)


def test_persistent_workers_resume_exactly_mid_epoch_and_between_epochs(tmp_path):
    def make() -> DataLoader:
        return DataLoader(Samples(14), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    check_exact_resume(tmp_path, make, keys=False, workers=2)
    # Between epochs: the next pass reuses the first pass's base seed, as torch's persistent workers do.
    torch.manual_seed(1)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(make())
    as_lists(loader)
    accelerator.save_state(tmp_path / "between")
    following, rng_after = as_lists(loader), torch.get_rng_state()
    torch.manual_seed(999)
    again = Accelerator(cpu=True)
    resumed = again.prepare(make())
    again.load_state(tmp_path / "between")
    assert as_lists(resumed) == following and torch.equal(torch.get_rng_state(), rng_after)


def check_exact_resume(tmp_path: Any, make: Callable[[], DataLoader], keys: bool, workers: int) -> None:
    """save_state in epoch 1, then a fresh Accelerator seeded differently: load_state and
    skip_first_batches give the rest of the epoch and the next one, and leave the RNG as it was."""
    torch.manual_seed(1)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(make())
    as_lists(loader)  # epoch 0
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(2)]
    accelerator.save_state(tmp_path / "ckpt")
    rest = [b.tolist() for b in iterator]
    rng_after = torch.get_rng_state()
    following = as_lists(loader)

    torch.manual_seed(999)  # a fresh run seeded differently: only the checkpoint may decide
    again = Accelerator(cpu=True)
    resumed_loader = again.prepare(make())
    again.load_state(tmp_path / "ckpt")
    assert resumed_loader.position.epoch == 1 and resumed_loader.position.batches_consumed == 2
    resumed_loader.dataset.loaded.clear()
    resumed = as_lists(again.skip_first_batches(resumed_loader, resumed_loader.position.batches_consumed))
    assert head and resumed == rest
    assert torch.equal(torch.get_rng_state(), rng_after)
    if workers == 0:  # the skipped batches were never loaded
        loaded = [b[0] // 10 for b in rest] if keys else [i for b in rest for i in b]
        assert sorted(resumed_loader.dataset.loaded) == sorted(loaded)
    assert as_lists(resumed_loader) == following


def test_the_state_dict_holds_the_order_and_refuses_one_it_cannot_replay():
    torch.manual_seed(2)
    with_generator = DataLoaderShard(DataLoader(Samples(8), batch_size=2, shuffle=True,
                                                generator=torch.Generator().manual_seed(1)), None, GradientState())
    assert with_generator.state_dict()["order"]["pass"] is None  # nothing drawn yet
    next(iter(with_generator))
    state = with_generator.state_dict()
    assert {"seed", "epoch", "batches_consumed", "order"} <= set(state)
    assert state["order"]["pass"]["epoch"] == 0 and len(state["order"]["generators"]) == 1
    plain = DataLoaderShard(DataLoader(Samples(8), batch_size=2, shuffle=True), None, GradientState())
    with pytest.raises(ValueError, match=r"'order'.*must hold 0 generator state\(s\).*Received: 1"):
        plain.load_state_dict(state)  # saved with a generator on the loader, loaded into one without
    assert plain.position.batches_consumed == 0 and plain.state_dict()["order"]["pass"] is None  # nothing changed


@pytest.mark.parametrize("kind", ["generator", "stateful_sampler"])
def test_loading_a_state_saved_between_epochs_repeats_the_next_epoch_without_touching_the_global_rng(kind):
    # A user's generator and a sampler's own state are not in the global RNG checkpoint: the loader keeps them.
    torch.manual_seed(3)
    loader = DataLoaderShard(_loaders(0)[kind](), None, GradientState())
    as_lists(loader)
    state, rng = loader.state_dict(), torch.get_rng_state()
    first = as_lists(loader)
    loader.load_state_dict(state)
    torch.set_rng_state(rng)
    assert as_lists(loader) == first


# ------------------------------------------------------------------ dealing ready batches to ranks
class FixedBatches(Sampler):
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def shard(loader: DataLoader, rank: int, world: int, **kwargs: Any) -> DataLoaderShard:
    return DataLoaderShard(loader, None, GradientState(), num_processes=world, process_index=rank, **kwargs)


def last_batch_marks(dl: DataLoaderShard) -> tuple[list[list[int]], int, int]:
    """The batches, and (remainder, real_ranks) as gather_for_metrics sees them on the last one."""
    got, marks = [], (0, 0)
    for batch in dl:
        got.append(batch.tolist())
        if dl.gradient_state.end_of_dataloader:
            marks = (dl.gradient_state.remainder, dl.gradient_state.real_ranks)
    assert dl.gradient_state.real_ranks == 0 and dl.gradient_state.remainder == 0  # reset after the pass
    return got, *marks


def test_batch_sampler_batches_go_whole_to_ranks_in_turn_and_the_last_round_is_padded_with_whole_batches():
    batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]
    loader = DataLoader(Samples(11), batch_sampler=FixedBatches(batches))
    r0 = last_batch_marks(shard(loader, 0, 2))
    r1 = last_batch_marks(shard(loader, 1, 2))
    assert r0 == ([[0, 1, 2], [4, 5], [10]], 1, 0)  # the last round's real samples: [10]
    assert r1 == ([[3], [6, 7, 8, 9], [0, 1, 2]], 1, 0)
    assert len(shard(loader, 1, 2)) == 3
    uneven = shard(loader, 1, 2, even_batches=False)
    assert as_lists(uneven) == [[3], [6, 7, 8, 9]] and len(uneven) == 2
    assert last_batch_marks(shard(loader, 0, 1)) == (batches, 0, 0)  # one process: nothing padded


def test_ready_batches_go_whole_to_ranks_and_mark_which_ranks_are_real_in_the_padded_round():
    loader = DataLoader(ReadyBatches(4), batch_size=None)  # keys 0..3 in 3 ranks: rounds [0 1 2] [3 pad pad]
    got = [last_batch_marks(shard(loader, r, 3)) for r in range(3)]
    assert got == [([[0], [30]], 0, 1), ([[10, 11], [0]], 0, 1), ([[20, 21, 22], [10, 11]], 0, 1)]
    assert [len(shard(loader, r, 3, even_batches=False)) for r in range(3)] == [2, 1, 1]


@pytest.mark.parametrize("n", [1, 2, 5, 6, 7])
@pytest.mark.parametrize("even_batches", [True, False])
def test_len_matches_the_batches_yielded_for_ready_batches(n, even_batches):
    for world in (1, 2, 3):
        per_rank = [as_lists(shard(DataLoader(ReadyBatches(n), batch_size=None), r, world, even_batches=even_batches))
                    for r in range(world)]
        assert [len(b) for b in per_rank] == [len(shard(DataLoader(ReadyBatches(n), batch_size=None), r, world,
                                                          even_batches=even_batches)) for r in range(world)]
        if even_batches:
            assert len({len(b) for b in per_rank}) == 1
        else:
            assert sorted(b[0] // 10 for bs in per_rank for b in bs) == list(range(n))


def test_ranks_drawing_the_same_rng_deal_one_order_that_matches_one_process():
    def rank_batches(rank: int, world: int) -> list[list[int]]:
        torch.manual_seed(13)
        return as_lists(shard(DataLoader(Samples(13), batch_sampler=RandomBuckets(13)), rank, world))

    one = rank_batches(0, 1)
    two = [rank_batches(r, 2) for r in range(2)]
    assert [b for k in range(len(two[0])) for b in (two[0][k], two[1][k])][:len(one)] == one


# ------------------------------------------------------------------ bad input
class NoLength(Sampler):
    def __iter__(self):
        return iter(range(4))


class YieldsInts(Sampler):
    def __iter__(self):
        return iter(range(4))

    def __len__(self) -> int:
        return 4


@pytest.mark.parametrize("build, name", [
    (lambda: DataLoader(Samples(4), batch_size=2, sampler=NoLength()), "`sampler` (NoLength)"),
    (lambda: DataLoader(Samples(4), batch_sampler=NoLength()), "`batch_sampler` (NoLength)"),
    (lambda: DataLoader(ReadyBatches(4), batch_size=None, sampler=NoLength()), "`sampler` (NoLength)"),
])
def test_a_sampler_without_len_is_refused_by_name(build, name):
    with pytest.raises(TypeError, match=name.replace("(", r"\(").replace(")", r"\)") + " has no len"):
        Accelerator(cpu=True).prepare(build())


def test_a_batch_sampler_that_yields_no_lists_is_refused_by_name():
    loader = Accelerator(cpu=True).prepare(DataLoader(Samples(4), batch_sampler=YieldsInts()))
    with pytest.raises(TypeError, match=r"`batch_sampler` must yield lists .* Received 0 \(int\) as batch 0"):
        next(iter(loader))
    tuples = DataLoader(Samples(4), batch_sampler=FixedBatches([(0, 1), torch.tensor([2, 3])]))
    assert as_lists(Accelerator(cpu=True).prepare(tuples)) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("loader, what", [
    (DataLoader(Samples(4), batch_sampler=FixedBatches([[0, 1], [2, 3]])), "batch_sampler=FixedBatches"),
    (DataLoader(ReadyBatches(4), batch_size=None), "batch_size=None"),
])
def test_split_batches_refuses_ready_batches(loader, what):
    with pytest.raises(ValueError, match=rf"`split_batches=True` cannot split .*{what}"):
        Accelerator(cpu=True, split_batches=True).prepare(loader)


# ------------------------------------------------------------------ the Trainer resumes exactly
class Noisy(TrainModule):
    """A regression with dropout, so training draws from the global RNG too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(1, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.float().reshape(-1, 1) / 40
        return nn.functional.mse_loss(self.net(x), x.sin())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["batch_sampler", "batch_size_none"])
def test_trainer_resumed_mid_epoch_ends_bitwise_identical(tmp_path, kind, workers):
    def make() -> DataLoader:
        if kind == "batch_sampler":
            return DataLoader(Samples(13), batch_sampler=RandomBuckets(13), num_workers=workers)
        return DataLoader(NoisyBatches(7), batch_size=None, shuffle=True, num_workers=workers)

    torch.manual_seed(5)
    full = Noisy()
    uninterrupted = Trainer(max_steps=11, project_dir=tmp_path / "full")
    uninterrupted.fit(full, make())
    torch.manual_seed(5)
    Trainer(max_steps=9, project_dir=tmp_path / "cut", callbacks=[Checkpointer(every_n_steps=9)]).fit(Noisy(), make())
    resumed = Noisy()
    torch.manual_seed(999)
    second = Trainer(max_steps=11, project_dir=tmp_path / "cut", resume_from="latest")
    second.fit(resumed, make())
    assert second.state.state_dict() == uninterrupted.state.state_dict()
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_load_state_refuses_a_checkpoint_saved_with_another_generator_setup_before_changing_anything(tmp_path):
    accelerator = Accelerator(cpu=True)
    saved = accelerator.prepare(DataLoader(Samples(8), batch_size=2, shuffle=True,
                                           generator=torch.Generator().manual_seed(1)))
    next(iter(saved))
    accelerator.save_state(tmp_path / "ckpt")
    other = Accelerator(cpu=True)
    loader = other.prepare(DataLoader(Samples(8), batch_size=2, shuffle=True))  # no generator= now
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"data_states_0\.pt.*'order'.*must hold 0 generator state"):
        other.load_state(tmp_path / "ckpt")
    assert loader.position.batches_consumed == 0 and torch.equal(torch.get_rng_state(), rng)
