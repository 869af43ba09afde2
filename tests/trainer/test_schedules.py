"""When the LR scheduler steps (fittrain/trainer/schedules.py): Lightning's lr_scheduler dict, read and stepped.

The first part tests `parse_optimizers` and the `Schedule` objects on a real Accelerator, without
the Trainer. The second part ("Trainer-level") fits real modules: it needs trainer.py to call the
schedule at its three points (`after_optimizer_step`, `after_validation`, `after_epoch`).
Refusals of bad dicts through `fit` are in test_bad_input.py.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from fittrain import Accelerator, Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import checks
from fittrain.trainer.configure import SchedulerConfig, parse_optimizers
from fittrain.trainer.schedules import EpochSchedule, MetricSchedule, Schedule, StepSchedule, make_schedule
from support.jobs import run, torchrun
from support.models import regression_loader

LR = 0.1
Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


class Net(TrainModule):
    """y = x·w; `configure(opt)` builds what configure_optimizers returns around an SGD optimizer.

    Not support.models' Regressor: validation also returns "flat", a metric that never improves.
    """

    def __init__(self, configure: Callable[[torch.optim.Optimizer], Any] = lambda opt: opt) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.configure = configure

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        # "flat" never improves, so a plateau scheduler with patience=0 reduces at each of its steps.
        return {"val_loss": self.training_step(batch), "flat": torch.tensor(1.0)}

    def configure_optimizers(self) -> Any:
        return self.configure(torch.optim.SGD(self.parameters(), lr=LR))


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def halving_plateau(opt: torch.optim.Optimizer, **kwargs: Any) -> Plateau:
    return Plateau(opt, **{"factor": 0.5, "patience": 0, **kwargs})


class MetricLR(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler of the user's own whose step takes a metric (Lightning's reduce_on_plateau=True)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        super().__init__(opt, lambda epoch: 1.0)
        self.seen: list[float] = []

    def step(self, metric: float | None = None) -> None:  # type: ignore[override]
        if metric is not None:
            self.seen.append(metric)
        super().step()


# ----------------------------------------------------------------- parse_optimizers
@pytest.mark.parametrize("form, expected", [
    (lambda o: o, None),
    (lambda o: (o, step_lr(o)), ("step", 1, None, True, None)),
    (lambda o: ([o], [step_lr(o)]), ("step", 1, None, True, None)),
    (lambda o: {"optimizer": o, "lr_scheduler": step_lr(o)}, ("step", 1, None, True, None)),
    (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "interval": "epoch", "frequency": 3,
                                                  "name": "lr/main"}}, ("epoch", 3, None, True, "lr/main")),
    # ReduceLROnPlateau: Lightning's top-level monitor; its interval defaults to "epoch", as in Lightning.
    (lambda o: {"optimizer": o, "lr_scheduler": Plateau(o), "monitor": "val_loss"},
     ("epoch", 1, "val_loss", True, None)),
    (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": Plateau(o), "monitor": "val_acc", "interval": "step",
                                                  "frequency": 2, "strict": False}},
     ("step", 2, "val_acc", False, None)),
    (lambda o: [{"optimizer": o, "lr_scheduler": {"scheduler": Plateau(o), "monitor": "val_loss"}}],
     ("epoch", 1, "val_loss", True, None)),
    (lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": MetricLR(o), "reduce_on_plateau": True,
                                                  "monitor": "val_loss"}}, ("epoch", 1, "val_loss", True, None)),
], ids=["optimizer", "pair", "lists", "dict", "dict-form", "plateau-top-monitor", "plateau-step", "list-of-dict",
        "own-metric-scheduler"])
def test_configure_optimizers_forms_are_read_into_a_config(form, expected):
    module = Net(form)
    optimizer, config = parse_optimizers(module)
    assert isinstance(optimizer, torch.optim.SGD)
    if expected is None:
        assert config is None
        return
    assert isinstance(config, SchedulerConfig) and config.scheduler.optimizer is optimizer
    assert (config.interval, config.frequency, config.monitor, config.strict, config.name) == expected


def test_several_optimizers_are_refused_in_automatic_optimization_pointing_to_manual():
    def two(o: torch.optim.Optimizer) -> tuple:
        return o, torch.optim.Adam(o.param_groups[0]["params"])

    with pytest.raises(ValueError, match="2 optimizers.*automatic_optimization = False"):
        parse_optimizers(Net(two))


# ----------------------------------------------------------------- the Schedule objects
def prepared_schedule(configure: Callable[[torch.optim.Optimizer], Any], validates: bool = True,
                      every_n_epochs: int | None = 1, every_n_steps: int | None = None) -> tuple[Schedule, Accelerator]:
    accelerator = Accelerator(cpu=True)
    module = Net(configure)
    optimizer, config = parse_optimizers(module)
    accelerator.prepare(module, optimizer)
    return make_schedule(config, accelerator, validates, every_n_epochs, every_n_steps), accelerator


def lr_of(schedule: Schedule) -> float:
    return schedule.scheduler.optimizer.param_groups[0]["lr"]


def test_no_scheduler_gives_a_schedule_that_does_nothing():
    schedule, accelerator = prepared_schedule(lambda o: o)
    assert type(schedule) is Schedule and schedule.scheduler is None and accelerator.prepared.schedulers == []
    schedule.after_optimizer_step(1)
    schedule.after_validation({}, epoch=0)
    schedule.after_epoch(0)


# No optimizer steps here, only the schedule's: torch's warning about that order is expected.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_interval_step_steps_every_frequency_optimizer_steps():
    schedule, accelerator = prepared_schedule(
        lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "frequency": 2}})
    assert type(schedule) is StepSchedule and accelerator.prepared.schedulers == [schedule.scheduler]
    assert schedule.scheduler.steps_per_call == 1  # optimizer steps, not per-process batches
    lrs = []
    for step in range(1, 7):
        schedule.after_optimizer_step(step)
        schedule.after_validation({"val_loss": 1.0}, step=step)  # not its point: nothing happens
        lrs.append(lr_of(schedule))
    schedule.after_epoch(0)
    assert lrs == [LR, LR / 2, LR / 2, LR / 4, LR / 4, LR / 8] and lr_of(schedule) == LR / 8


def test_interval_step_does_not_advance_after_an_fp16_skipped_step():
    schedule, accelerator = prepared_schedule(lambda o: (o, step_lr(o)))
    accelerator.gradient_state.step_was_skipped = True
    schedule.after_optimizer_step(1)
    assert lr_of(schedule) == LR


def test_interval_epoch_steps_every_frequency_epochs():
    schedule, _ = prepared_schedule(
        lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "interval": "epoch", "frequency": 2}})
    assert type(schedule) is EpochSchedule
    lrs = []
    for epoch in range(4):
        schedule.after_optimizer_step(epoch + 1)  # not its point: nothing happens
        schedule.after_epoch(epoch)
        lrs.append(lr_of(schedule))
    assert lrs == [LR, LR / 2, LR / 2, LR / 4]


def test_a_plateau_steps_on_the_monitor_after_the_validations_its_interval_names():
    schedule, _ = prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": halving_plateau(o), "monitor": "flat", "frequency": 2}})
    assert type(schedule) is MetricSchedule
    metrics = {"val_loss": 0.5, "flat": torch.tensor(1.0)}  # a tensor is read as its float
    lrs = []
    for epoch in range(6):
        schedule.after_optimizer_step(epoch + 1)
        schedule.after_validation(metrics, step=epoch + 1)  # a mid-epoch validation: not for interval "epoch"
        schedule.after_epoch(epoch)
        schedule.after_validation(metrics, epoch=epoch)
        lrs.append(lr_of(schedule))
    # Steps after epochs 1, 3, 5: the first sets the best value, each later one reduces.
    assert lrs == [LR, LR, LR, LR / 2, LR / 2, LR / 4]
    assert schedule.scheduler.scheduler.last_epoch == 3


def test_a_plateau_with_interval_step_steps_after_mid_epoch_validations():
    schedule, _ = prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": halving_plateau(o), "monitor": "flat", "interval": "step", "frequency": 2}},
        every_n_epochs=None, every_n_steps=1)
    lrs = []
    for step in range(1, 7):
        schedule.after_validation({"flat": 1.0}, step=step)
        schedule.after_validation({"flat": 1.0}, epoch=step)  # an epoch-end validation: not for interval "step"
        lrs.append(lr_of(schedule))
    assert lrs == [LR, LR, LR, LR / 2, LR / 2, LR / 4]


def test_a_scheduler_of_ones_own_with_reduce_on_plateau_gets_the_metric():
    schedule, _ = prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": MetricLR(o), "reduce_on_plateau": True, "monitor": "val_loss"}})
    schedule.after_validation({"val_loss": torch.tensor(0.25)}, epoch=0)
    assert schedule.scheduler.scheduler.seen == [0.25]


def test_a_missing_monitor_names_the_metrics_that_exist():
    schedule, _ = prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": halving_plateau(o), "monitor": "val_acc"}})
    with pytest.raises(ValueError) as info:
        schedule.after_validation({"val_loss": 0.5, "train_loss": torch.tensor(0.7)}, epoch=0)
    message = str(info.value)
    for fragment in ("`monitor`", "lr_scheduler dict", "ReduceLROnPlateau", "monitor='val_acc'",
                     "Metrics that exist: ['train_loss', 'val_loss']", "validation_step"):
        assert fragment in message, message
    assert "\n" not in message


def test_a_missing_monitor_with_strict_false_warns_once_and_does_not_step():
    schedule, _ = prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": halving_plateau(o), "monitor": "val_acc", "strict": False}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            schedule.after_validation({"val_loss": 0.5}, epoch=epoch)
    assert len(caught) == 1 and "strict=False" in str(caught[0].message) and "val_acc" in str(caught[0].message)
    assert schedule.scheduler.scheduler.last_epoch == 0 and lr_of(schedule) == LR


@pytest.mark.parametrize("interval, validates, every_n_epochs, every_n_steps, fragments", [
    ("epoch", False, 1, None, ("no val_loader", "never step", "Pass a val_loader")),
    ("step", False, None, 5, ("no val_loader", "never step")),
    ("epoch", True, None, 5, ("interval='epoch'", "val_every_n_steps=5", "middle of epochs",
                              "{'interval': 'step', 'frequency': 5}")),
    ("step", True, 2, None, ("interval='step'", "val_every_n_epochs=2", "only at epoch ends",
                             "'interval': 'epoch'", "val_every_n_steps=n")),
])
def test_a_plateau_that_no_validation_would_step_is_refused(interval, validates, every_n_epochs, every_n_steps,
                                                             fragments):
    accelerator = Accelerator(cpu=True)
    module = Net(lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": Plateau(o), "monitor": "val_loss",
                                                             "interval": interval}})
    _, config = parse_optimizers(module)
    with pytest.raises(ValueError) as info:
        make_schedule(config, accelerator, validates, every_n_epochs, every_n_steps)
    for fragment in ("ReduceLROnPlateau", "monitor='val_loss'", *fragments):
        assert fragment in str(info.value), str(info.value)
    assert accelerator.prepared.schedulers == []  # refused before anything was prepared


def test_a_plateau_state_travels_in_checkpoints(tmp_path):
    def run(seed: int) -> tuple[Schedule, Accelerator]:
        torch.manual_seed(seed)
        return prepared_schedule(lambda o: {"optimizer": o, "lr_scheduler": {
            "scheduler": halving_plateau(o, patience=1), "monitor": "val_loss"}})

    schedule, accelerator = run(0)
    for epoch, value in enumerate([1.0, 2.0, 2.0, 0.5, 0.9]):
        schedule.after_validation({"val_loss": value}, epoch=epoch)
    saved = schedule.scheduler.state_dict()
    assert saved["num_bad_epochs"] == 1 and saved["best"] == 0.5 and saved["mode_worse"] == math.inf
    accelerator.save_state(tmp_path / "ckpt")
    on_disk = torch.load(tmp_path / "ckpt" / "scheduler.pt", weights_only=True)
    checks.check_dict(tmp_path / "ckpt" / "scheduler.pt", on_disk, "an LR scheduler")
    assert on_disk == saved

    resumed, other = run(1)
    other.load_state(tmp_path / "ckpt")
    assert resumed.scheduler.state_dict() == saved and lr_of(resumed) == lr_of(schedule) == LR / 2
    resumed.after_validation({"val_loss": 0.9}, epoch=5)  # the second bad epoch in a row: reduces
    assert lr_of(resumed) == LR / 4


# ----------------------------------------------------------------- Trainer-level
# These fit real modules: they pass once trainer.py steps its scheduler through fittrain.trainer.schedules.
class LRHistory(Callback):
    """Records the learning rate after every batch and at every epoch end."""

    def __init__(self) -> None:
        self.records: list[tuple[str, int, float]] = []

    def on_train_batch_end(self, trainer: Trainer) -> None:
        self.records.append(("step", trainer.state.global_step, trainer.optimizer.param_groups[0]["lr"]))

    def on_train_epoch_end(self, trainer: Trainer) -> None:
        self.records.append(("epoch", trainer.state.epoch, trainer.optimizer.param_groups[0]["lr"]))

    def lrs(self, kind: str) -> list[float]:
        return [lr for k, _, lr in self.records if k == kind]


def fit_history(tmp_path, configure: Callable[[torch.optim.Optimizer], Any], val: bool = True,
                **trainer_args: Any) -> tuple[Trainer, LRHistory]:
    history = LRHistory()
    trainer = Trainer(project_dir=tmp_path, callbacks=[history], **trainer_args)
    trainer.fit(Net(configure), regression_loader(12), regression_loader(12) if val else None)
    return trainer, history


def test_fit_steps_interval_step_every_frequency_optimizer_steps(tmp_path):
    # 3 batches an epoch, 2 per optimizer step: the last step of an epoch takes 1 batch.
    trainer, history = fit_history(
        tmp_path, lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": step_lr(o), "frequency": 2}},
        max_epochs=2, gradient_accumulation_steps=2)
    steps = [(step, lr) for kind, step, lr in history.records if kind == "step"]
    assert trainer.state.global_step == 4
    assert steps == [(0, LR), (1, LR), (2, LR / 2), (2, LR / 2), (3, LR / 2), (4, LR / 4)]


def test_fit_steps_interval_epoch_every_frequency_epochs(tmp_path):
    trainer, history = fit_history(tmp_path, lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": step_lr(o), "interval": "epoch", "frequency": 2}}, max_epochs=5)
    assert history.lrs("epoch") == [LR, LR / 2, LR / 2, LR / 4, LR / 4]
    assert trainer.scheduler is trainer.accelerator.prepared.schedulers[0]


def test_fit_steps_a_plateau_only_after_validations_never_on_an_old_value(tmp_path):
    # Validation every 2nd epoch: the plateau steps after epochs 1, 3, 5 (the first sets the best).
    _, history = fit_history(tmp_path, lambda o: {"optimizer": o, "lr_scheduler": halving_plateau(o),
                                                  "monitor": "flat"}, max_epochs=6, val_every_n_epochs=2)
    assert history.lrs("epoch") == [LR, LR, LR, LR / 2, LR / 2, LR / 4]


def test_fit_steps_a_plateau_with_interval_step_after_mid_epoch_validations(tmp_path):
    _, history = fit_history(tmp_path, lambda o: {"optimizer": o, "lr_scheduler": {
        "scheduler": halving_plateau(o), "monitor": "flat", "interval": "step", "frequency": 4}},
        max_steps=12, val_every_n_steps=2)
    # Validations after steps 2, 4, ..., 12; the plateau steps after those at 4, 8, 12, before the batch ends.
    assert history.lrs("step") == [LR] * 7 + [LR / 2] * 4 + [LR / 4]


def test_fit_has_no_scheduler_without_one(tmp_path):
    trainer, history = fit_history(tmp_path, lambda o: o, max_epochs=1)
    assert trainer.scheduler is None and history.lrs("epoch") == [LR]


def test_fit_names_a_monitor_that_validation_does_not_produce(tmp_path):
    with pytest.raises(ValueError, match=r"monitor='val_acc'.*Metrics that exist: \['flat', 'train_loss', "
                                         r"'val_loss'\]"):
        fit_history(tmp_path, lambda o: {"optimizer": o, "lr_scheduler": {"scheduler": Plateau(o),
                                                                          "monitor": "val_acc"}}, max_epochs=2)


def test_fit_refuses_a_plateau_without_validation_before_training(tmp_path):
    module = Net(lambda o: {"optimizer": o, "lr_scheduler": Plateau(o), "monitor": "val_loss"})
    before = module.net.weight.detach().clone()
    with pytest.raises(ValueError, match="no val_loader.*never step"):
        Trainer(project_dir=tmp_path, max_epochs=1).fit(module, regression_loader(12))
    assert torch.equal(before, module.net.weight)


class Interrupted(Exception):
    """Stands for a crash after a checkpoint was saved."""


class InterruptAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise Interrupted(f"interrupted at step {self.step}")


def falling(opt: torch.optim.Optimizer) -> Plateau:
    """Reduces after every 2nd validation while val_loss falls (mode "max"): its state spans checkpoints."""
    return Plateau(opt, mode="max", factor=0.5, patience=1, threshold=0.0)


RESUME_CASES = {
    # name: (lr_scheduler, Trainer arguments, the step after which the first run is interrupted)
    "plateau-epoch": (lambda o: {"scheduler": falling(o), "monitor": "val_loss"},
                      {}, 7),
    "plateau-epoch-at-epoch-end": (
        lambda o: {"scheduler": falling(o), "monitor": "val_loss"}, {}, 6),
    "plateau-step": (lambda o: {"scheduler": falling(o), "monitor": "val_loss",
                                "interval": "step", "frequency": 2}, {"val_every_n_steps": 2}, 8),
    "epoch-frequency-2": (lambda o: {"scheduler": step_lr(o), "interval": "epoch", "frequency": 2}, {}, 7),
    "epoch-frequency-2-at-epoch-end": (lambda o: {"scheduler": step_lr(o), "interval": "epoch", "frequency": 2}, {}, 6),
    "step-frequency-2": (lambda o: {"scheduler": step_lr(o), "frequency": 2}, {}, 7),
}


def resume_run(tmp_path, case: str, history: LRHistory, interrupt: int | None = None,
               resume: bool = False) -> Trainer:
    scheduler, trainer_args, _ = RESUME_CASES[case]
    torch.manual_seed(999 if resume else 0)  # whatever the checkpoint does not restore then differs
    callbacks = [Checkpointer(every_n_steps=1, total_limit=2), history]
    callbacks += [InterruptAt(interrupt)] if interrupt else []
    trainer = Trainer(project_dir=tmp_path, max_epochs=5, callbacks=callbacks,
                      resume_from="latest" if resume else None, **trainer_args)
    trainer.fit(Net(lambda o: {"optimizer": o, "lr_scheduler": scheduler(o)}), regression_loader(12, shuffle=True),
                regression_loader(12))
    return trainer


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
# A resumed epoch-end step comes before the resumed process's first optimizer step: torch must not warn.
@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)`")
def test_interrupt_and_resume_give_the_same_weights_and_lr_history(tmp_path, case):
    full_history, first, second = LRHistory(), LRHistory(), LRHistory()
    full = resume_run(tmp_path / "full", case, full_history)
    with pytest.raises(Interrupted):
        resume_run(tmp_path / "split", case, first, interrupt=RESUME_CASES[case][2])
    resumed = resume_run(tmp_path / "split", case, second, resume=True)
    assert len({lr for *_, lr in full_history.records}) >= 3, "the LR hardly changed: the test would prove little"
    assert first.records + second.records == full_history.records
    for name, value in full.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[name]), name
    assert resumed.scheduler.state_dict() == full.scheduler.state_dict()


PLATEAU_WORKER = '''
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fittrain import Callback, Trainer, TrainModule


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch):
        return self.training_step(batch)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        # train_loss, the last batch's loss, differs between the processes.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0, threshold=0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}


class History(Callback):
    def __init__(self):
        self.lrs = []

    def on_train_epoch_end(self, trainer):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


torch.manual_seed(0)
x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
y = x.sum(1, keepdim=True) + torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
history = History()
trainer = Trainer(project_dir=sys.argv[1], max_epochs=8, callbacks=[history])
data = TensorDataset(x, y)
trainer.fit(Net(), DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=8))
rank = trainer.accelerator.process_index
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"lrs": history.lrs, "weight": trainer.module.net.weight.tolist(),
               "world": trainer.accelerator.num_processes}, f)
'''


@pytest.mark.subprocess
def test_two_processes_step_a_plateau_alike_on_a_metric_that_differs_between_them(tmp_path):
    script = tmp_path / "plateau_worker.py"
    script.write_text(PLATEAU_WORKER)
    run(torchrun(2, script, tmp_path)).check()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert len(set(ranks[0]["lrs"])) >= 2, ranks[0]["lrs"]  # the plateau reduced the LR at least once
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["weight"] == ranks[1]["weight"]
