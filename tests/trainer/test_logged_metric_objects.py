"""torchmetrics Metric objects given to `self.log` (fittrain/trainer/metric_objects.py): values as
Lightning gives them, states kept by checkpoints so a resumed epoch ends with the same value, and
clear errors. The comparison with Lightning itself is in tests/lightning/test_lightning_torchmetrics.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Trainer
from fittrain.callbacks import Checkpointer
from fittrain.trainer.metric_objects import merge_state
from support.jobs import load_script

torchmetrics = pytest.importorskip("torchmetrics")
# SpearmanCorrCoef keeps every prediction, and says so each time one is made.
pytestmark = pytest.mark.filterwarnings("ignore:Metric `SpearmanCorrcoef` will save")


def make_loader(n: int = 10, batch_size: int = 4) -> DataLoader:
    """10 samples in batches of 4, 4, 2: three steps an epoch."""
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


#: The module every test here fits (and the 2-process job too): see its docstring.
Measured = load_script("metric_objects_worker").Measured


def _fit(folder, module, **options) -> Trainer:
    options = {"max_epochs": 2, "project_dir": folder, "enable_progress_bar": False, **options}
    trainer = Trainer(**options)
    trainer.fit(module, make_loader(), make_loader())
    return trainer


def test_step_epoch_and_validation_values_are_lightnings(tmp_path):
    module = Measured()
    metrics = _fit(tmp_path, module, max_epochs=1).state.metrics
    x, y = make_loader().dataset.tensors
    # The step value is the batch's own MAE; the epoch value the MAE over every sample of the epoch.
    errors = []
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for xb, yb in make_loader():
        pred = net(xb)
        errors.append((pred - yb).abs().detach())
        optimizer.zero_grad()
        nn.functional.mse_loss(pred, yb).backward()
        optimizer.step()
    assert [value for _, value in module.steps] == pytest.approx([float(e.mean()) for e in errors], rel=1e-6)
    assert metrics["mae_epoch"] == pytest.approx(float(torch.cat(errors).mean()), rel=1e-6)
    assert metrics["val_mae"] == pytest.approx(float((net(x) - y).abs().mean().detach()), rel=1e-6)
    assert -1 <= metrics["rho"] <= 1
    assert metrics["mse"] == pytest.approx(float(torch.cat(errors).pow(2).mean()), rel=1e-6)
    # Every metric logged is reset once its epoch or loop ended, as Lightning does.
    assert [m._update_count for m in (module.mae, module.spearman, module.val_mae, module.mse)] == [0, 0, 0, 0]


@pytest.mark.parametrize("cut_after_steps", [4, 3], ids=["mid-epoch", "at-an-epoch-end"])
def test_a_resumed_epoch_ends_with_the_same_metric_values(tmp_path, cut_after_steps):
    whole = _fit(tmp_path / "whole", Measured()).state.raw_metrics
    every_step = [Checkpointer(every_n_steps=1)]
    _fit(tmp_path / "cut", Measured(), max_steps=cut_after_steps, callbacks=every_step)
    resumed = _fit(tmp_path / "cut", Measured(), resume_from="latest", callbacks=every_step).state.raw_metrics
    # Bitwise: the restored states are the saved tensors, updated by the same batches in the same order.
    for name in ("mae_epoch", "rho", "val_mae", "mse"):
        assert resumed[name] == whole[name], name


def test_a_metric_that_is_not_an_attribute_cannot_be_checkpointed_and_says_so(tmp_path):
    class Local(Measured):
        def training_step(self, batch, batch_idx):
            metric = self.__dict__.setdefault("hidden", torchmetrics.MeanAbsoluteError())  # not a submodule
            x, y = batch
            metric(self.net(x), y)
            self.log("hidden_mae", metric, on_epoch=True)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"cannot keep the state of the MeanAbsoluteError logged with self\.log in "
                                         r"this epoch: it is not an attribute of the module\. Assign it in __init__"):
        _fit(tmp_path, Local(), callbacks=[Checkpointer(every_n_steps=1)])


def test_a_checkpoint_with_states_of_a_metric_the_module_lacks_is_refused_naming_it(tmp_path):
    _fit(tmp_path, Measured(), max_steps=4, callbacks=[Checkpointer(every_n_steps=1)])

    class Lacking(Measured):
        def __init__(self):
            super().__init__()
            self.spearman = nn.Identity()

    with pytest.raises(Exception, match=r"holds the states of a torchmetrics Metric at 'spearman' of the module, but "
                                        r"Lacking has no Metric there"):
        _fit(tmp_path, Lacking(), resume_from="latest")


@pytest.mark.parametrize("log, message", [
    (lambda m, loss: (m.log("x", loss, on_epoch=True), m.log("x", m.mae, on_epoch=True)),
     r"self\.log\('x_epoch', \.\.\.\) was called with a torchmetrics Metric after reduce_fx='mean'"),
    (lambda m, loss: (m.log("x", m.mae, on_epoch=True), m.log("x", loss, on_epoch=True)),
     r"self\.log\('x_epoch', \.\.\.\) was called with reduce_fx='mean', sync_dist=False after a torchmetrics Metric"),
])
def test_mixing_a_metric_and_tensors_under_one_name_is_refused(tmp_path, log, message):
    class Mixed(Measured):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            log(self, loss.detach())
            return loss

    with pytest.raises(ValueError, match=message):
        _fit(tmp_path, Mixed(), max_epochs=1)


def test_a_metric_only_updated_has_no_step_value(tmp_path):
    class Updated(Measured):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("rho_step_only", self.spearman)  # update() ran, forward did not: no value of this batch
            return loss

    metrics = _fit(tmp_path, Updated(), max_epochs=1).state.raw_metrics
    assert "rho_step_only" not in metrics and "rho" in metrics


def test_a_metric_whose_value_is_not_one_number_is_refused_naming_it(tmp_path):
    class Wide(Measured):
        def __init__(self):
            super().__init__()
            self.wide = torchmetrics.MeanAbsoluteError(num_outputs=2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.wide(torch.cat([x[:, :1], x[:, 1:2]], 1), torch.cat([y, y], 1))
            self.log("wide", self.wide)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"self\.log\('wide', MeanAbsoluteError\): the metric's forward returned "
                                         r"tensor\(\[.*\]\); self\.log takes a metric whose value is one number"):
        _fit(tmp_path, Wide(), max_epochs=1)


class Hinted(Measured):
    """Measured, and a second MAE in a ModuleDict logged with Lightning's `metric_attribute` hint (`attribute`)."""

    def __init__(self, attribute):
        super().__init__()
        self.held = nn.ModuleDict({"mae": torchmetrics.MeanAbsoluteError()})
        self.attribute = attribute

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.held["mae"](self.net(x), y)  # the same values as self.mae's, before the step
        loss = super().training_step(batch, batch_idx)
        self.log("hinted", self.held["mae"], on_epoch=True, metric_attribute=self.attribute)
        self.log("plain", loss.detach(), metric_attribute="ignored for a tensor, as in Lightning")
        return loss


def test_metric_attribute_naming_the_logged_metric_is_accepted_and_changes_nothing(tmp_path):
    plain = _fit(tmp_path / "plain", Measured(), max_epochs=1).state.raw_metrics
    hinted = _fit(tmp_path / "hinted", Hinted("held.mae"), max_epochs=1).state.raw_metrics
    assert hinted["hinted_epoch"] == hinted["mae_epoch"] == plain["mae_epoch"]
    assert "plain" in hinted


@pytest.mark.parametrize("attribute", ["mae_typo", "spearman", 3])
def test_a_metric_attribute_that_does_not_hold_the_metric_is_refused_naming_the_paths(tmp_path, attribute):
    with pytest.raises(ValueError, match=rf"Hinted\.log\('hinted', MeanAbsoluteError, metric_attribute="
                                         rf"{attribute!r}\): the logged Metric is not there\. Pass the submodule path "
                                         r"that holds it \(the module's Metrics: 'mae', 'spearman', 'val_mae', 'mse', "
                                         r"'held\.mae'\), or leave metric_attribute out"):
        _fit(tmp_path, Hinted(attribute), max_epochs=1)


@pytest.mark.subprocess
def test_two_processes_resume_their_own_states_and_one_process_resumes_them_merged(tmp_path):
    from support.jobs import forked, forked_process, run
    from support.results import read_results

    run(forked(2, "metric_objects_worker.py", "--out", tmp_path)).check()
    ranks = read_results(tmp_path, 2)
    for rank in ranks:
        # Each process got its own states back: the synced epoch values are the uninterrupted run's, bitwise.
        assert rank["resumed"] == rank["whole"] == ranks[0]["whole"]
    # On one process, process 0 holds both processes' states merged (sums added, lists joined); with
    # lr=0 every prediction is the same on any number of processes, so the values are the whole run's
    # up to the order of the float sums.
    run(forked_process("metric_objects_worker.py", "--out", tmp_path, "--elastic")).check()
    elastic = torch.load(tmp_path / "elastic.pt", weights_only=True)
    assert elastic == pytest.approx(ranks[0]["still_whole"], rel=1e-6)


@pytest.mark.parametrize("reduction, merged", [
    ("dim_zero_sum", torch.tensor([4.0, 6.0])), ("dim_zero_max", torch.tensor([3.0, 4.0])),
    ("dim_zero_min", torch.tensor([1.0, 2.0])), ("dim_zero_cat", torch.tensor([1.0, 2.0, 3.0, 4.0])),
])
def test_states_saved_by_several_processes_merge_as_torchmetrics_reduces_them(reduction, merged):
    from torchmetrics.utilities import data

    saved = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    assert torch.equal(merge_state("m", "s", getattr(data, reduction), saved), merged)
    assert merge_state("m", "s", data.dim_zero_cat, [[saved[0]], [saved[1]]]) == [saved[0], saved[1]]  # a list state


def test_a_state_that_cannot_be_merged_is_refused_on_another_process_count():
    from torchmetrics.utilities import data

    with pytest.raises(ValueError, match=r"Metric at 'acc' from 2 processes; this run has another number of "
                                         r"processes, and its state 'total' \(reduced with dim_zero_mean\) cannot "
                                         r"be merged\. Resume on 2 processes"):
        merge_state("acc", "total", data.dim_zero_mean, [torch.tensor(1.0), torch.tensor(2.0)])
