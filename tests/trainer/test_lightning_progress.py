"""A fit shows progress without a Logger (Lightning's `enable_progress_bar`, on by default)."""

from __future__ import annotations

import pytest

from fittrain import Trainer
from fittrain.callbacks import Checkpointer, Logger, ProgressBar
from support.models import Regressor, regression_loader


def test_a_fit_without_callbacks_shows_progress_and_says_where_things_went(tmp_path, capsys):
    trainer = Trainer(max_epochs=2, project_dir=tmp_path, run_name="demo", callbacks=[Checkpointer(every_n_epochs=1)])
    trainer.fit(Regressor(), regression_loader(n=8), regression_loader(n=8))
    shown = capsys.readouterr()
    assert "Epoch 0" in shown.err and "Epoch 1" in shown.err  # the bar, drawn for each epoch
    assert (f"Training run 'demo': checkpoints in {tmp_path / 'checkpoints' / 'demo'}; no logs (add "
            "fittrain.callbacks.Logger to write them).") in shown.out
    assert "Fit done: 2 epoch(s), 4 optimizer step(s); train_loss=" in shown.out and "val_loss=" in shown.out
    assert [type(cb) for cb in trainer.callbacks] == [Checkpointer, ProgressBar]


def test_without_a_checkpointer_the_start_line_says_how_to_save(tmp_path, capsys):
    Trainer(project_dir=tmp_path, run_name="plain").fit(Regressor(), regression_loader(n=8))
    assert ("Training run 'plain': no checkpoints (add fittrain.callbacks.Checkpointer to save them); "
            "no logs (add fittrain.callbacks.Logger to write them).") in capsys.readouterr().out


def test_enable_progress_bar_false_shows_and_prints_nothing_a_loggers_bars_included(tmp_path, capsys):
    trainer = Trainer(project_dir=tmp_path, enable_progress_bar=False, callbacks=[Logger(log_with=[])])
    trainer.fit(Regressor(), regression_loader(n=8))
    assert capsys.readouterr() == ("", "")
    assert not any(isinstance(cb, ProgressBar) for cb in trainer.callbacks)


@pytest.mark.parametrize("given", [Logger(log_with=[]), Logger(log_with=[], progress_bar=False), ProgressBar()],
                         ids=["logger", "logger-without-bars", "progress-bar"])
def test_a_callback_that_draws_progress_gets_no_second_bar(tmp_path, given):
    trainer = Trainer(project_dir=tmp_path, callbacks=[given])
    assert trainer.callbacks == [given]


def test_a_loggers_bar_says_where_its_logs_go(tmp_path, capsys):
    Trainer(project_dir=tmp_path, run_name="logged", callbacks=[Logger()]).fit(Regressor(), regression_loader(n=8))
    shown = capsys.readouterr().out
    assert f"logs in {tmp_path / 'logs' / 'logged'}." in shown and "Fit done: 1 epoch(s)" in shown
    assert (tmp_path / "logs" / "logged").is_dir()


def test_enable_progress_bar_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match=r"enable_progress_bar=\.\.\.\)` must be True or False\. "
                                        r"Received: enable_progress_bar='yes'"):
        Trainer(project_dir=tmp_path, enable_progress_bar="yes")


def _epoch_lines(err: str) -> list[str]:
    """The terminal lines a bar output leaves: each line's last redraw (after its last carriage return)."""
    return [line.rsplit("\r", 1)[-1] for line in err.split("\n") if "Epoch " in line]


@pytest.mark.parametrize("options", [{"leave": True}, {"leave": False}, {}], ids=["leave", "reset", "default"])
def test_leave_keeps_a_line_per_epoch_or_resets_one_bar(tmp_path, capsys, options):
    Trainer(max_epochs=3, project_dir=tmp_path, callbacks=[ProgressBar(**options)]).fit(
        Regressor(), regression_loader(n=8))
    lines = _epoch_lines(capsys.readouterr().err)
    if options.get("leave", False):  # Keras's way: each epoch's finished bar stays
        assert [line.split(":")[0] for line in lines] == ["Epoch 0", "Epoch 1", "Epoch 2"]
        assert all("2/2" in line for line in lines)
    else:  # the default, Lightning's TQDMProgressBar's: one bar, reset at each epoch, left at the last one
        assert len(lines) == 1 and lines[0].startswith("Epoch 2") and "2/2" in lines[0]


def test_progress_bar_leave_must_be_a_bool():
    with pytest.raises(TypeError, match=r"ProgressBar\(leave=\.\.\.\)|leave"):
        ProgressBar(leave="no")
