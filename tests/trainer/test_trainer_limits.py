"""Trainer(limit_*_batches=, fast_dev_run=, overfit_batches=, deterministic=): Lightning's loop arguments.

Real fits on the CPU in one process: 16 indexed samples in batches of 4 (4 batches an epoch),
the shared Regressor recording which samples each step read (loop_support.py). The 2-process
behaviour is in test_loop_args_ddp.py.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer, Logger
from fittrain.trainer.limits import LoopLimits, batches_to_run, check_limit
from loop_support import Indexed, assert_same_parameters, loader, recorder, resumed_run


def trainer(tmp_path: pathlib.Path, callbacks: list[Callback] | None = None, **kwargs: Any) -> Trainer:
    kwargs.setdefault("enable_progress_bar", False)
    return Trainer(callbacks=callbacks, project_dir=tmp_path, **kwargs)


def epoch_orders(epochs: int, seed: int = 1) -> list[list[list[int]]]:
    """The batches of indices a plain shuffling DataLoader with generator seed `seed` gives in each epoch."""
    plain = DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return [[batch[2].tolist() for batch in plain] for _ in range(epochs)]


def shuffled(seed: int = 1) -> DataLoader:
    return loader(shuffle=True, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- limit_train_batches
@pytest.mark.parametrize("limit, per_epoch", [(2, 2), (0.5, 2), (0.3, 1), (1.0, 4), (4, 4), (10, 4), (2.0, 2)])
def test_each_epoch_trains_the_first_batches_of_its_own_order(tmp_path, limit, per_epoch):
    module = recorder()
    fit = trainer(tmp_path, max_epochs=3, limit_train_batches=limit)
    fit.fit(module, shuffled())
    expected = [(epoch, ids) for epoch, order in enumerate(epoch_orders(3)) for ids in order[:per_epoch]]
    assert module.trained == expected
    assert fit.num_training_batches == per_epoch and fit.state.global_step == 3 * per_epoch


def test_the_last_batch_of_a_limited_epoch_closes_the_accumulation_window(tmp_path):
    synced: list[bool] = []

    class Syncs(Callback):
        def on_train_batch_end(self, trainer: Trainer) -> None:
            synced.append(trainer.accelerator.sync_gradients)

    fit = trainer(tmp_path, [Syncs()], max_epochs=2, limit_train_batches=5, gradient_accumulation_steps=3)
    fit.fit(recorder(), loader(n=32))  # 8 batches an epoch, 5 of them trained
    assert synced == [False, False, True, False, True] * 2
    assert fit.state.global_step == 4


def test_limit_train_batches_zero_trains_nothing(tmp_path):
    module = recorder()
    fit = trainer(tmp_path, max_epochs=2, limit_train_batches=0)
    fit.fit(module, loader())
    assert module.trained == [] and fit.state.global_step == 0 and fit.num_training_batches == 0


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(16):
            yield torch.randn(3), torch.randn(1), i


def test_a_stream_takes_an_int_limit_and_refuses_a_fraction(tmp_path):
    module = recorder()
    fit = trainer(tmp_path, max_epochs=2, limit_train_batches=3)
    fit.fit(module, DataLoader(Stream(), batch_size=4))
    assert [ids for _, ids in module.trained] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2
    with pytest.raises(ValueError, match=r"limit_train_batches=0.5.*has none.*Pass an int"):
        trainer(tmp_path / "b", limit_train_batches=0.5).fit(recorder(), DataLoader(Stream(), batch_size=4))


def test_a_fraction_below_one_batch_is_refused_naming_the_smallest(tmp_path):
    with pytest.raises(ValueError, match=r"limit_train_batches=0.1.*0.1 \* 4 < 1.*at least limit_train_batches=0.25"):
        trainer(tmp_path, limit_train_batches=0.1).fit(recorder(), loader())


@pytest.mark.parametrize("bad", [True, -1, -0.5, 1.5, "all", [2]])
def test_bad_limits_are_refused_at_construction(bad):
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                 "overfit_batches"):
        with pytest.raises(ValueError, match=rf"`Trainer\({name}=...\)` must be.*Received: {name}="):
            Trainer(**{name: bad})


def test_check_limit_and_batches_to_run_follow_lightnings_rounding():
    assert [check_limit("x", v) for v in (None, 0, 3, 0.0, 0.25, 1.0, 7.0)] == [None, 0, 3, 0.0, 0.25, 1.0, 7]
    ten = list(range(10))
    assert [batches_to_run("x", v, ten) for v in (None, 3, 10, 11, 0.25, 0.99, 1.0, 0.0, 0)] == \
        [None, 3, None, None, 2, 9, None, 0, 0]


# ----------------------------------------------------------------- exact resume in a limited epoch
def _limited(tmp_path: pathlib.Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    return trainer(tmp_path, callbacks, max_epochs=3, limit_train_batches=3, **kwargs)


def _fit_shuffled(fit: Trainer, module: Any) -> None:
    fit.fit(module, loader(shuffle=True), loader())  # the order comes from the global RNG


@pytest.mark.parametrize("resume_step", [2, 3, 4], ids=["mid-epoch", "last-batch-of-the-limit", "next-epoch"])
def test_a_limited_epoch_resumes_bitwise_exactly(tmp_path, resume_step):
    full_module = recorder()
    full = _limited(tmp_path / "full", [Checkpointer(every_n_steps=1)])
    _fit_shuffled(full, full_module)
    resumed, first, module = resumed_run(tmp_path / "cut", _limited, _fit_shuffled, crash_at=5,
                                         resume_step=resume_step)
    assert_same_parameters(module, full_module)
    assert resumed.state.global_step == full.state.global_step == 9
    assert first.trained[:resume_step] + module.trained == full_module.trained  # the same batches, in order
    assert module.validated == full_module.validated[-len(module.validated):]


# ----------------------------------------------------------------- evaluation limits
def test_validation_test_and_predict_run_their_limits(tmp_path):
    module = recorder()
    fit = trainer(tmp_path, max_epochs=2, limit_val_batches=2, limit_test_batches=0.5, limit_predict_batches=1)
    fit.fit(module, loader(), loader())
    assert [ids for _, ids in module.validated] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert fit.num_val_batches == 2
    module.validated.clear()
    fit.validate(module, loader())
    assert len(module.validated) == 2
    module.validated.clear()
    assert set(fit.test(module, loader(n=32))) == {"test_loss"} and len(module.validated) == 4
    assert fit.num_test_batches == 4
    assert fit.predict(module, loader()).shape == (4, 1) and fit.num_predict_batches == 1
    # The limited loops leave no pass open: a full validation afterwards runs every batch.
    module.validated.clear()
    trainer(tmp_path / "b").validate(module, loader())
    assert len(module.validated) == 4


def test_limit_zero_skips_a_loop_and_its_events(tmp_path):
    seen: list[str] = []

    class Events(Callback):
        def on_validation_start(self, trainer: Trainer) -> None:
            seen.append("validation")

        def on_test_start(self, trainer: Trainer) -> None:
            seen.append("test")

        def on_predict_start(self, trainer: Trainer) -> None:
            seen.append("predict")

    module = recorder()
    fit = trainer(tmp_path, [Events()], limit_val_batches=0, limit_test_batches=0, limit_predict_batches=0.0,
                  num_sanity_val_steps=2)
    fit.fit(module, loader(), loader())
    assert fit.validate(module, loader()) == {} and fit.test(module, loader()) == {}
    assert fit.predict(module, loader()) == []
    assert seen == [] and module.validated == [] and fit.state.global_step == 4


# ----------------------------------------------------------------- fast_dev_run
@pytest.mark.parametrize("value, n", [(True, 1), (3, 3)])
def test_fast_dev_run_runs_n_batches_of_each_loop_and_mutes_checkpoints_and_logs(tmp_path, capsys, value, n):
    module = recorder()
    fit = Trainer(callbacks=[Checkpointer(every_n_steps=1, every_n_epochs=1), Logger(run_name="run")],
                  project_dir=tmp_path, fast_dev_run=value, max_epochs=5, num_sanity_val_steps=2,
                  limit_train_batches=0.5)
    line = capsys.readouterr().out
    assert line.startswith(f"Running in fast_dev_run mode: at most {n} optimizer step(s)")
    assert "Overrides max_epochs=5, limit_train_batches=0.5." in line
    fit.fit(module, loader(n=64), loader(n=64))
    assert fit.state.global_step == n and fit.state.epoch == 1 and len(module.trained) == n
    assert len(module.validated) == n  # one validation of n batches, no sanity check
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()
    assert "fast_dev_run mode: no checkpoints, no logs" in capsys.readouterr().out
    assert len(fit.predict(module, loader(n=64))) == 4 * n and fit.num_predict_batches == n


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("yes", TypeError), (None, TypeError)])
def test_bad_fast_dev_run_is_refused(bad, error):
    with pytest.raises(error, match=r"`Trainer\(fast_dev_run=...\)` must be True, False or an int >= 0"):
        Trainer(fast_dev_run=bad)


def test_fast_dev_run_off_changes_nothing(tmp_path):
    fit = trainer(tmp_path, fast_dev_run=False, max_epochs=2)
    fit.fit(recorder(), loader())
    assert fit.state.global_step == 8


# ----------------------------------------------------------------- overfit_batches
def test_overfit_batches_trains_the_same_first_batches_in_order_every_epoch(tmp_path):
    module = recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, max_epochs=3, overfit_batches=2)
        fit.fit(module, shuffled(), shuffled(seed=2))
    for name in ("train_loader", "val_loader"):
        assert sum(f"reads `{name}` in order: its RandomSampler is replaced" in str(w.message) for w in caught) == 1
    assert [ids for _, ids in module.trained] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 3
    # Validation reads its own loader (Lightning 2's rule), in order too, limited alike.
    assert [ids for _, ids in module.validated] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 3


def test_overfit_batches_fraction_overrides_limits_with_a_warning(tmp_path):
    module = recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, max_epochs=1, overfit_batches=0.25, limit_train_batches=3, limit_val_batches=3)
        fit.fit(module, loader(), loader())
    assert any("overriding limit_train_batches=3, limit_val_batches=3" in str(w.message) for w in caught)
    assert [ids for _, ids in module.trained] == [[0, 1, 2, 3]]
    assert not any("SequentialSampler" in str(w.message) for w in caught)  # already in order: no warning


def test_overfit_batches_refuses_a_loader_it_cannot_rebuild(tmp_path):
    custom = DataLoader(Indexed(), batch_sampler=BatchSampler(RandomSampler(Indexed()), 4, False))
    with pytest.raises(ValueError, match="overfit_batches.*cannot be rebuilt with a SequentialSampler"):
        trainer(tmp_path, overfit_batches=1).fit(recorder(), custom)


def _overfit(tmp_path: pathlib.Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sampler is replaced
        return trainer(tmp_path, callbacks, max_epochs=3, overfit_batches=2, **kwargs)


def test_overfit_batches_resumes_bitwise_exactly(tmp_path):
    full_module = recorder()
    full = _overfit(tmp_path / "full", [Checkpointer(every_n_steps=1)])
    _fit_shuffled(full, full_module)
    resumed, first, module = resumed_run(tmp_path / "cut", _overfit, _fit_shuffled, crash_at=4, resume_step=3)
    assert_same_parameters(module, full_module)
    assert first.trained[:3] + module.trained == full_module.trained
    assert resumed.state.global_step == 6


# ----------------------------------------------------------------- the resolved limits
def test_lightnings_precedence_of_overfit_batches_and_fast_dev_run():
    limits = LoopLimits.resolve({"train": 5, "val": None, "test": 0.5, "predict": None}, 3, 2, 4, lambda m: None)
    assert (limits.train, limits.val, limits.test, limits.predict, limits.sanity) == (3, 3, 2, 2, 0)
    limits = LoopLimits.resolve({"train": 5, "val": None, "test": 0.5, "predict": None}, 0, 0, -1, lambda m: None)
    assert (limits.train, limits.val, limits.test, limits.predict, limits.sanity) == (5, None, 0.5, None, None)


# ----------------------------------------------------------------- deterministic
@pytest.fixture
def restore_determinism():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.benchmark = before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


@pytest.mark.parametrize("value, enabled, warn_only", [(True, True, False), ("warn", True, True)])
def test_deterministic_switches_torch_as_lightning_does(restore_determinism, value, enabled, warn_only):
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.backends.cudnn.benchmark = True
    Trainer(deterministic=value)
    assert torch.are_deterministic_algorithms_enabled() is enabled
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.backends.cudnn.benchmark is False and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    Trainer(deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    Trainer()  # None: leaves torch as it is
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("bad", ["yes", 1, "True"])
def test_bad_deterministic_is_refused(bad):
    with pytest.raises(ValueError, match=r"`Trainer\(deterministic=...\)` must be one of None, True, False, 'warn'"):
        Trainer(deterministic=bad)
