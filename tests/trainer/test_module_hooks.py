"""A TrainModule takes part in the loop: Lightning's hook names and arguments, before the callbacks.

See fittrain/trainer/module_hooks.py. The first test is the one that failed before modules had
hooks: a module's `on_train_epoch_end` and `on_validation_epoch_end` were silently never called.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fittrain import Callback, Trainer
from fittrain.callbacks import Checkpointer, EarlyStop
from fittrain.trainer.events import EVENT_NAMES
from fittrain.trainer.module_hooks import MODULE_HOOKS, bind_module_hooks
from support.models import Regressor, regression_loader


class Linear(Regressor):
    """The shared regressor, predicting from a batch's inputs."""

    def predict_step(self, batch):
        return self(batch[0])


def _describe(value):
    """A short, comparable description of a hook argument."""
    if isinstance(value, torch.optim.Optimizer) or hasattr(value, "optimizer"):
        return "optimizer"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return value


class Recording(Linear):
    """Records every event hook with what it received; `log` is the shared list."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.calls = log


for _hook in MODULE_HOOKS:
    setattr(Recording, _hook.name,
            lambda self, *args, _n=_hook.name: self.calls.append(("module", _n, [_describe(a) for a in args])))


class CallbackRecorder(Callback):
    def __init__(self, log: list) -> None:
        self.calls = log


for _name in EVENT_NAMES:
    setattr(CallbackRecorder, _name, lambda self, trainer, *args, _n=_name: self.calls.append(("callback", _n)))


def test_a_modules_epoch_end_hooks_are_called_once_per_epoch(tmp_path):
    class Counting(Linear):
        def __init__(self):
            super().__init__()
            self.train_epochs_ended = self.validations_ended = 0

        def on_train_epoch_end(self):
            self.train_epochs_ended += 1

        def on_validation_epoch_end(self):
            self.validations_ended += 1

    module = Counting()
    Trainer(max_epochs=2, project_dir=tmp_path).fit(module, regression_loader(n=8), regression_loader(n=8))
    assert (module.train_epochs_ended, module.validations_ended) == (2, 2)


def test_module_hooks_get_lightnings_arguments_and_run_before_the_callbacks(tmp_path):
    log: list = []
    Trainer(callbacks=[CallbackRecorder(log)], max_epochs=1, gradient_accumulation_steps=2,
            project_dir=tmp_path).fit(Recording(log), regression_loader(n=8), regression_loader(n=4))
    batch = [["tensor(4, 3)", "tensor(4, 1)"]]

    def both(name, *args):
        return [("module", name, list(args)), ("callback", name)]

    def train_batch(index, sync):
        steps = both("on_train_batch_start", *batch, index) + both("on_before_backward", "tensor()")
        steps += both("on_after_backward")
        if sync:
            steps += both("on_before_optimizer_step", "optimizer")
        return steps + both("on_train_batch_end", "tensor()", *batch, index)

    expected = [*both("on_fit_start"), *both("on_train_start"), *both("on_train_epoch_start"),
                *train_batch(0, False), *train_batch(1, True),
                ("module", "on_validation_start", []), ("module", "on_validation_epoch_start", []),
                ("callback", "on_validation_start"),
                *both("on_validation_batch_start", *batch, 0), *both("on_validation_batch_end", "tensor()", *batch, 0),
                ("module", "on_validation_epoch_end", []), ("module", "on_validation_end", []),
                ("callback", "on_validation_end"),
                *both("on_train_epoch_end"), *both("on_train_end"), *both("on_fit_end")]
    assert log == expected


def test_test_and_predict_fire_the_modules_hooks_with_each_batch(tmp_path):
    log: list = []
    trainer = Trainer(project_dir=tmp_path)
    module = Recording(log)
    trainer.test(module, regression_loader(n=4, batch_size=4))
    trainer.predict(module, regression_loader(n=4, batch_size=4))
    batch = [["tensor(4, 3)", "tensor(4, 1)"]]
    assert log == [("module", "on_test_start", []), ("module", "on_test_epoch_start", []),
                   ("module", "on_test_batch_start", [*batch, 0]),
                   ("module", "on_test_batch_end", ["tensor()", *batch, 0]),
                   ("module", "on_test_epoch_end", []), ("module", "on_test_end", []),
                   ("module", "on_predict_start", []), ("module", "on_predict_epoch_start", []),
                   ("module", "on_predict_batch_start", [*batch, 0]),
                   ("module", "on_predict_batch_end", ["tensor(4, 1)", *batch, 0]),
                   ("module", "on_predict_epoch_end", []), ("module", "on_predict_end", [])]


def test_a_metric_logged_in_on_validation_epoch_end_is_what_early_stop_and_the_checkpointer_see(tmp_path):
    class Scored(Linear):
        """Logs a made-up score per validation; it is best at the second one."""

        def __init__(self):
            super().__init__()
            self.scores = iter([0.5, 0.9, 0.1, 0.2, 0.3])

        def on_validation_epoch_end(self):
            self.log("score", next(self.scores))

    stop = EarlyStop(monitor="score", mode="max", patience=2)
    keeper = Checkpointer(every_n_epochs=1, monitor="score", mode="max", save_top_k=1)
    trainer = Trainer(callbacks=[stop, keeper], max_epochs=5, project_dir=tmp_path)
    trainer.fit(Scored(), regression_loader(n=8), regression_loader(n=8))
    assert trainer.state.epoch == 4  # best at epoch 1, then two without improvement
    assert trainer.best_score == pytest.approx(0.9)


def test_a_module_keeps_its_own_entries_in_checkpoints_and_gets_them_back_on_resume(tmp_path):
    class Keeping(Linear):
        def __init__(self):
            super().__init__()
            self.seen = 0
            self.loaded: dict | None = None

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.seen += len(batch[0])

        def on_save_checkpoint(self, checkpoint):
            checkpoint["seen"] = self.seen
            checkpoint["scale"] = torch.tensor([2.0])

        def on_load_checkpoint(self, checkpoint):
            self.loaded = checkpoint
            self.seen = checkpoint["seen"]

    first = Keeping()
    Trainer(callbacks=[Checkpointer(every_n_epochs=1)], max_epochs=1, project_dir=tmp_path).fit(
        first, regression_loader(n=8))
    resumed = Keeping()
    Trainer(callbacks=[Checkpointer(every_n_epochs=1)], max_epochs=2, project_dir=tmp_path,
            resume_from="latest").fit(resumed, regression_loader(n=8))
    assert resumed.loaded["seen"] == 8 and torch.equal(resumed.loaded["scale"], torch.tensor([2.0]))
    assert resumed.seen == 16


def test_checkpoint_entries_a_checkpoint_cannot_load_back_fail_the_save_naming_the_hook(tmp_path):
    class Pickly(Linear):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["model"] = nn.Linear(1, 1)

    with pytest.raises(TypeError, match=r"Pickly\.on_save_checkpoint\(checkpoint\) put into checkpoint"):
        Trainer(callbacks=[Checkpointer(every_n_epochs=1)], project_dir=tmp_path).fit(Pickly(), regression_loader(n=8))


def test_manual_optimization_hooks_receive_the_backward_loss_and_the_stepping_optimizer(tmp_path):
    seen: list = []

    class TwoOptimizers(Linear):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.other = nn.Linear(3, 1)

        def training_step(self, batch):
            x, y = batch
            first, second = self.optimizers()
            for opt, net in ((first, self.net), (second, self.other)):
                loss = nn.functional.mse_loss(net(x), y)
                self.manual_backward(loss)
                opt.step()
                opt.zero_grad()
            return loss

        def configure_optimizers(self):
            return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]

        def on_before_backward(self, loss):
            seen.append(("backward", loss.requires_grad))

        def on_before_optimizer_step(self, optimizer):
            seen.append(("step", self.optimizers().index(optimizer)))

    Trainer(max_steps=1, project_dir=tmp_path).fit(TwoOptimizers(), regression_loader(n=4))
    assert seen == [("backward", True), ("step", 0), ("backward", True), ("step", 1)]


def test_an_on_method_that_is_no_hook_is_refused_before_anything_runs(tmp_path):
    class Typo(Linear):
        def on_validation_epoch_ends(self):
            raise AssertionError("never called")

        def training_step(self, batch):
            raise AssertionError("the check comes first")

    with pytest.raises(ValueError, match=r"Typo defines on_validation_epoch_ends, which is not a TrainModule hook, "
                                         r"so it would never run\. Did you mean on_validation_epoch_end\?"):
        Trainer(project_dir=tmp_path).fit(Typo(), regression_loader(n=8))


def test_a_lightning_1_hook_name_points_to_its_successor(tmp_path):
    class Old(Linear):
        def on_epoch_end(self):
            pass

    with pytest.raises(ValueError, match=r"on_epoch_end.*Did you mean on_train_epoch_end\?"):
        Trainer(project_dir=tmp_path).validate(Old(), regression_loader(n=8))


def test_a_hook_whose_signature_cannot_take_its_arguments_is_refused_naming_both(tmp_path):
    class Lazy(Linear):
        def on_train_batch_end(self):
            pass

    with pytest.raises(TypeError, match=r"Lazy\.on_train_batch_end\(\) cannot take the arguments it is called "
                                        r"with: on_train_batch_end\(self, outputs, batch, batch_idx\)"):
        Trainer(project_dir=tmp_path).fit(Lazy(), regression_loader(n=8))


def test_an_error_in_a_module_hook_names_it_and_reaches_on_exception(tmp_path):
    class Failing(Linear):
        def __init__(self):
            super().__init__()
            self.exceptions: list = []

        def on_train_epoch_start(self):
            raise RuntimeError("boom")

        def on_exception(self, exception):
            self.exceptions.append(exception)

    module = Failing()
    with pytest.raises(RuntimeError, match="boom") as caught:
        Trainer(project_dir=tmp_path).fit(module, regression_loader(n=8))
    assert "Raised in module Failing.on_train_epoch_start." in caught.value.__notes__
    assert module.exceptions == [caught.value]


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_an_error_in_a_per_batch_hook_is_noted_with_its_name(tmp_path, hook):
    """The loop calls on_train_batch_end's hooks itself (not through fire): the note is the same."""
    class Failing(Linear):
        pass

    def fail(self, *args):
        raise ValueError("bad batch")

    setattr(Failing, hook, fail)
    with pytest.raises(ValueError, match="bad batch") as caught:
        Trainer(project_dir=tmp_path).fit(Failing(), regression_loader(n=8))
    assert caught.value.__notes__ == [f"Raised in module Failing.{hook}."]


def test_a_module_without_hooks_binds_none():
    assert all(hooks == () for hooks in bind_module_hooks(Linear()).values())
