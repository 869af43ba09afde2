"""Trainer(enable_model_summary=True): the parameter table a fit prints, laid out as Lightning's."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fittrain import Trainer, TrainModule
from fittrain.callbacks import Logger
from fittrain.trainer.summary import human_count, summarize
from support.models import Regressor, regression_loader


class Autoencoder(TrainModule):
    """Nested, frozen, eval-mode and loose parameters: every kind of row and count the table has."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 3))
        self.decoder = nn.Linear(3, 784)
        self.norm = nn.BatchNorm1d(3).eval()
        self.scale = nn.Parameter(torch.ones(5))
        self.decoder.weight.requires_grad_(False)


def without_flops(table: str) -> str:
    """Lightning's table without its FLOPs column and total (fittrain's has none: see summary.py)."""
    lines = [line for line in table.splitlines() if not line.endswith("Total Flops")]
    header = re.sub(r" \| FLOPs\s*$", "", lines[0])
    rule = "-" * (len(header) + 6)  # Lightning's rule: the columns' widths and 3 per column, one column more
    return "\n".join(rule if set(line) == {"-"} else re.sub(r" \| [^|]*$", "", line) if " | " in line else line
                     for line in lines)


@pytest.mark.parametrize("depth", [1, 2, -1, 0])
def test_the_table_is_lightnings(depth):
    summary = pytest.importorskip("lightning.pytorch.utilities.model_summary")
    pl = pytest.importorskip("lightning.pytorch")

    class Same(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            ours = Autoencoder()
            self.encoder, self.decoder, self.norm, self.scale = ours.encoder, ours.decoder, ours.norm, ours.scale

    assert summarize(Autoencoder(), depth) == without_flops(str(summary.summarize(Same(), max_depth=depth)))


def totals(table: str) -> dict[str, str]:
    """The table's totals, by label: {"Trainable params": "51.2 K", ...}."""
    return {line[10:]: line[:10].strip() for line in table.splitlines()[-6:]}


def test_the_totals_count_the_parameters_and_their_bytes():
    model = Autoencoder()
    parameters = list(model.parameters())
    total, trainable = sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad)
    assert totals(summarize(model)) == {
        "Trainable params": human_count(trainable), "Non-trainable params": human_count(total - trainable),
        "Total params": human_count(total), "Total estimated model params size (MB)": f"{total * 4 / 1e6:,.3f}",
        "Modules in train mode": "5", "Modules in eval mode": "1"}
    rows = summarize(model).splitlines()[2:6]
    assert [row.split(" | ")[1].strip() for row in rows] == ["encoder", "decoder", "norm", "other params"]
    counts = [sum(p.numel() for p in part.parameters()) for part in (model.encoder, model.decoder, model.norm)]
    assert [row.split(" | ")[3].strip() for row in rows] == [
        human_count(n).strip() for n in [*counts, model.scale.numel()]]
    # The size is the parameters' own bytes: half of it in bfloat16.
    assert totals(summarize(model.to(torch.bfloat16)))["Total estimated model params size (MB)"] == \
        f"{total * 2 / 1e6:,.3f}"


def test_human_counts_are_lightnings():
    summary = pytest.importorskip("lightning.pytorch.utilities.model_summary.model_summary")
    for number in (0, 7, 123, 999, 1000, 1234, 99_999, 123_456, 1e6, 2.5e6, 3e9, 4e14, 5e15):
        assert human_count(number) == summary.get_human_readable_count(number)


@pytest.mark.parametrize("bad", [-2, 1.0, "1", True])
def test_bad_max_depth_is_refused(bad):
    with pytest.raises(ValueError, match=r"`max_depth` must be an int >= -1.*Received: max_depth="):
        summarize(Autoencoder(), bad)


@pytest.mark.parametrize("callbacks", [[], [Logger(log_with=[])]], ids=["default-bar", "logger-bar"])
def test_the_progress_display_prints_it_once_when_fit_starts(tmp_path, capsys, callbacks):
    Trainer(callbacks=callbacks, project_dir=tmp_path).fit(Regressor(), regression_loader())
    out = capsys.readouterr().out
    assert out.count(summarize(Regressor())) == 1
    assert out.index(summarize(Regressor())) < out.index("Training run")  # at fit start, before training


@pytest.mark.parametrize("kwargs, callbacks", [({"enable_model_summary": False}, []),
                                               ({"enable_progress_bar": False}, []),
                                               ({}, [Logger(log_with=[], progress_bar=False)])],
                         ids=["switched-off", "no-progress", "logger-without-bar"])
def test_without_a_display_or_switched_off_it_is_not_printed(tmp_path, capsys, kwargs, callbacks):
    Trainer(project_dir=tmp_path, callbacks=callbacks, **kwargs).fit(Regressor(), regression_loader())
    assert "Trainable params" not in capsys.readouterr().out


def test_bad_enable_model_summary_is_refused():
    with pytest.raises(ValueError, match=r"`Trainer\(enable_model_summary=...\)` must be True or False"):
        Trainer(enable_model_summary="yes")
