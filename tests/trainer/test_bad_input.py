"""Bad input to the Trainer fails early, as a TypeError or ValueError that names the argument,
the value received and what is allowed, on one line of plain text.

Everything is refused at `Trainer(...)` or at the start of `fit`, before the first optimizer step.
"""

from __future__ import annotations

import signal
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer, EarlyStop, GradClip
from support.models import Regressor, regression_loader


def raises(error: type[Exception], call: Callable[[], Any], *fragments: str) -> str:
    """Runs `call`, checks it raises exactly `error` with every fragment in a one-line plain message."""
    with pytest.raises(Exception) as info:
        call()
    message = str(info.value)
    assert type(info.value) is error, f"{type(info.value).__name__}: {message}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert "\n" not in message and "\x1b" not in message, message
    return message


def fit_untouched(tmp_path, module: Regressor, error: type[Exception], *fragments: str, train: Any = "default") -> str:
    """fit raises `error`, and the module's weights never changed: no optimizer step ran."""
    before = module.net.weight.detach().clone()
    train = regression_loader(8) if train == "default" else train
    message = raises(error, lambda: Trainer(project_dir=tmp_path).fit(module, train), *fragments)
    assert torch.equal(before, module.net.weight)
    return message


# ----------------------------------------------------------------- Trainer(...)
def test_accelerator_must_be_an_accelerator():
    raises(TypeError, lambda: Trainer(accelerator="cpu"), "`accelerator`", "accelerator='cpu'",
           "fittrain.Accelerator or None", "Accelerator(cpu=True)")


def test_a_single_callback_must_be_passed_as_a_list():
    raises(TypeError, lambda: Trainer(callbacks=GradClip(max_norm=1.0)), "`callbacks`", "single callback",
           "callbacks=GradClip(...)", "callbacks=[GradClip(...)]")
    raises(TypeError, lambda: Trainer(callbacks="GradClip"), "`callbacks`", "callbacks='GradClip'")


def test_a_callback_that_is_not_one_is_named_in_one_line():
    raises(TypeError, lambda: Trainer(callbacks=[nn.Sequential(nn.Linear(2, 2), nn.ReLU())]),
           "`callbacks`", "<Sequential>", "Subclass fittrain.Callback")


def test_project_dir_and_resume_from_must_be_paths():
    raises(TypeError, lambda: Trainer(project_dir=123), "`project_dir`", "project_dir=123", "str or os.PathLike")
    raises(TypeError, lambda: Trainer(resume_from=3), "`resume_from`", "resume_from=3", "or None")


def test_preemption_signals_must_be_a_list_of_catchable_signals():
    raises(TypeError, lambda: Trainer(preemption_signals=None), "`preemption_signals`", "preemption_signals=None",
           "()")
    raises(TypeError, lambda: Trainer(preemption_signals="SIGTERM"), "preemption_signals='SIGTERM'",
           "preemption_signals=('SIGTERM',)")
    raises(ValueError, lambda: Trainer(preemption_signals=["SIGKILL"]), "`preemption_signals`", "SIGKILL",
           "'SIGKILL'", "'SIGTERM'")
    raises(ValueError, lambda: Trainer(preemption_signals=[signal.SIGSTOP]), "SIGSTOP")
    raises(ValueError, lambda: Trainer(preemption_signals=[True]), "`preemption_signals`", "True")


def test_two_checkpointers_are_refused():
    raises(ValueError, lambda: Trainer(callbacks=[Checkpointer(every_n_steps=1), Checkpointer(every_n_epochs=1)]),
           "`callbacks`", "2 Checkpointers", "Checkpointer(", "every_n_steps and every_n_epochs")


# ----------------------------------------------------------------- fit(...)
def test_fit_without_a_train_loader(tmp_path):
    fit_untouched(tmp_path, Regressor(), TypeError, "`train_loader`", "train_loader=None", train=None)
    fit_untouched(tmp_path, Regressor(), TypeError, "`train_loader`", "train_loader=3", train=3)


def _sgd(module: Regressor) -> torch.optim.SGD:
    return torch.optim.SGD(module.parameters(), lr=0.1)


def _step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1)


def test_scheduler_must_be_an_lr_scheduler(tmp_path):
    fit_untouched(tmp_path, Regressor(optimizers=lambda m: (_sgd(m), "sched")), TypeError, "configure_optimizers",
                  "must be an LR scheduler", "Received: 'sched'.")
    other = _sgd(Regressor())
    fit_untouched(tmp_path, Regressor(optimizers=lambda m: (_sgd(m), _step_lr(other))), ValueError, "StepLR",
                  "another optimizer")


@pytest.mark.parametrize("form", ["tuple", "list", "lists", "dicts"])
def test_two_optimizers_are_refused_not_taken_as_a_scheduler(tmp_path, form):
    def two(m: Regressor) -> Any:
        opt_g, opt_d = torch.optim.SGD(m.net.parameters(), lr=0.1), torch.optim.Adam(m.net.parameters())
        return {"tuple": (opt_g, opt_d), "list": [opt_g, opt_d], "lists": ([opt_g, opt_d], [_step_lr(opt_g)]),
                "dicts": ({"optimizer": opt_g}, {"optimizer": opt_d})}[form]

    fit_untouched(tmp_path, Regressor(optimizers=two), ValueError, "configure_optimizers", "2 optimizers",
                  "automatic_optimization = False", "parameter group")


@pytest.mark.parametrize("scheduler_dict, fragments", [
    ({"interval": "epcoh"}, ("`interval`", "interval='epcoh'", "'step' or 'epoch'")),
    ({"intervall": "step"}, ("Unknown key 'intervall'", "Allowed keys: scheduler, interval, frequency, monitor, "
                                                        "strict, name, reduce_on_plateau")),
    ({"monitor": "val_loss"}, ("'monitor'", "StepLR", "without a metric", "monitor='val_loss'", "Remove 'monitor'")),
    ({"strict": "yes"}, ("`strict`", "strict='yes'", "True or False")),
    ({"frequency": 0}, ("`frequency`", "frequency=0", "a positive integer")),
    ({"frequency": 2.0}, ("`frequency`", "frequency=2.0", "a positive integer")),
    ({"frequency": True}, ("`frequency`", "frequency=True", "a positive integer")),
    ({"name": 3}, ("`name`", "name=3", "a str or None")),
    ({"reduce_on_plateau": "no"}, ("`reduce_on_plateau`", "reduce_on_plateau='no'", "True or False")),
    ({"reduce_on_plateau": True}, ("StepLR", "steps on a metric", "no 'monitor'", "'monitor': 'val_loss'")),
    ({"opt_idx": 0}, ("Unknown key 'opt_idx'", "Allowed keys")),
])
def test_bad_lr_scheduler_dicts(tmp_path, scheduler_dict, fragments):
    def configure(m: Regressor) -> dict:
        opt = _sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _step_lr(opt), **scheduler_dict}}

    fit_untouched(tmp_path, Regressor(optimizers=configure), ValueError, "lr_scheduler dict", *fragments)


def test_bad_top_level_keys_and_a_missing_scheduler(tmp_path):
    def misspelt(m: Regressor) -> dict:
        opt = _sgd(m)
        return {"optimizer": opt, "lr_schedular": _step_lr(opt)}

    fit_untouched(tmp_path, Regressor(optimizers=misspelt), ValueError, "Unknown key 'lr_schedular'",
                  "optimizer, lr_scheduler, monitor")
    monitored = Regressor(optimizers=lambda m: {"optimizer": _sgd(m), "monitor": "val_loss"})
    fit_untouched(tmp_path, monitored, ValueError, "'monitor'", "no scheduler to drive", "monitor='val_loss'",
                  "ReduceLROnPlateau(optimizer)")
    no_scheduler = Regressor(optimizers=lambda m: {"optimizer": _sgd(m), "lr_scheduler": {"interval": "epoch"}})
    fit_untouched(tmp_path, no_scheduler, ValueError, "no 'scheduler' key", "{'interval': 'epoch'}")


def _plateau(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt)


@pytest.mark.parametrize("form", ["pair", "dict", "scheduler dict"])
def test_reduce_lr_on_plateau_needs_a_monitor(tmp_path, form):
    def plateau(m: Regressor) -> Any:
        opt = _sgd(m)
        return {"pair": (opt, _plateau(opt)), "dict": {"optimizer": opt, "lr_scheduler": _plateau(opt)},
                "scheduler dict": {"optimizer": opt, "lr_scheduler": {"scheduler": _plateau(opt)}}}[form]

    fit_untouched(tmp_path, Regressor(optimizers=plateau), ValueError, "ReduceLROnPlateau", "steps on a metric",
                  "no 'monitor'", "'monitor': 'val_loss'")


def test_reduce_lr_on_plateau_cannot_be_told_it_takes_no_metric(tmp_path):
    def plateau(m: Regressor) -> dict:
        opt = _sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _plateau(opt), "reduce_on_plateau": False,
                                                   "monitor": "val_loss"}}

    fit_untouched(tmp_path, Regressor(optimizers=plateau), ValueError, "ReduceLROnPlateau", "reduce_on_plateau=False",
                  "Remove 'reduce_on_plateau'")


@pytest.mark.parametrize("monitor", ["", 3])
def test_a_monitor_must_be_a_metric_name(tmp_path, monitor):
    def plateau(m: Regressor) -> dict:
        opt = _sgd(m)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _plateau(opt), "monitor": monitor}}

    fit_untouched(tmp_path, Regressor(optimizers=plateau), ValueError, "`monitor`", f"monitor={monitor!r}",
                  "a metric name")


def test_a_bad_configure_optimizers_return_is_summarised_in_one_line(tmp_path):
    message = fit_untouched(tmp_path, Regressor(optimizers=lambda m: m.net), TypeError, "configure_optimizers",
                            "Received: Linear.")
    assert "in_features" not in message  # a type name, not the object's repr


def test_optimizer_over_another_models_parameters(tmp_path):
    stranger = nn.Linear(5, 2)
    fit_untouched(tmp_path, Regressor(optimizers=lambda m: torch.optim.SGD(stranger.parameters(), lr=0.1)), ValueError,
                  "configure_optimizers", "SGD over 2 parameter(s)", "not parameters of Regressor", "(2, 5), (2,)",
                  "self.parameters()")


class _Detached(Regressor):
    def training_step(self, batch: Any) -> torch.Tensor:
        return super().training_step(batch).detach()


class _NoGrad(Regressor):
    def training_step(self, batch: Any) -> torch.Tensor:
        with torch.no_grad():
            return super().training_step(batch)


@pytest.mark.parametrize("module_class", [_Detached, _NoGrad])
def test_a_loss_without_grad_names_training_step(tmp_path, module_class):
    fit_untouched(tmp_path, module_class(), ValueError, "training_step", "does not require grad",
                  "requires_grad=False", "Received: tensor(")


# ----------------------------------------------------------------- NaN losses
class _NaNAfter(Regressor):
    """The loss becomes NaN from the given optimizer step on."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_from = step

    def training_step(self, batch: Any) -> torch.Tensor:
        loss = super().training_step(batch)
        return loss * float("nan") if self.global_step >= self.nan_from else loss


class _LossStaysLazy(Callback):
    """Records whether the recorded loss is still a tensor after each batch: nothing converted it."""

    def __init__(self) -> None:
        self.lazy: list[bool] = []

    def on_train_batch_end(self, trainer: Trainer) -> None:
        self.lazy.append(isinstance(trainer.state.raw_metrics["train_loss"], torch.Tensor))


def test_a_nan_loss_warns_once_naming_the_step_without_reading_it_every_step(tmp_path):
    probe = _LossStaysLazy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(callbacks=[probe], max_epochs=3, project_dir=tmp_path).fit(_NaNAfter(step=3), regression_loader(16))
    nan_warnings = [str(w.message) for w in caught if "training loss is nan" in str(w.message)]
    assert len(nan_warnings) == 1, nan_warnings
    assert "at optimizer step 4 (epoch 0)" in nan_warnings[0] and "\n" not in nan_warnings[0]
    assert all(probe.lazy)  # no per-step float(): on a GPU each would be a device sync


def test_early_stop_on_train_loss_stops_at_a_nan_loss(tmp_path):
    """The warning's advice works: EarlyStop(check_finite=True) decides after validation, so with a
    val_loader it ends the run after the epoch whose training loss became NaN."""
    trainer = Trainer(callbacks=[EarlyStop(monitor="train_loss", patience=100)], max_epochs=5, project_dir=tmp_path)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(_NaNAfter(step=3), regression_loader(16), regression_loader(4))
    messages = [str(w.message) for w in caught]
    assert any("EarlyStop stops training: train_loss=nan" in m for m in messages), messages
    assert any("training loss is nan at optimizer step 4" in m and "EarlyStop(monitor='train_loss')" in m
               for m in messages), messages
    assert trainer.state.epoch == 1 and trainer.state.should_stop
