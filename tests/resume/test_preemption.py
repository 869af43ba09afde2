"""Preemption: SIGTERM (or SIGUSR1) makes fit finish the optimizer step, save, and exit with 75.

`resume_from="latest"` in a fresh process then ends bitwise identical to the uninterrupted run,
and fit leaves the process's previous signal handlers in place.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import re
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from fittrain import Callback, Trainer
from fittrain.checkpoint.run_folders import run_checkpoints
from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE, PreemptionWatcher, ignore_preemption_signals
from resume_support import OTHER_SEED, TRAIN_JOB, assert_bitwise_equal, load_summary, train_job
from support.jobs import Job, torchrun

pytestmark = pytest.mark.subprocess


def test_sigterm_saves_exits_75_and_resume_is_exact(tmp_path, resume_references):
    resume_references.start()
    project, progress, go = tmp_path / "run", tmp_path / "progress", tmp_path / "go"
    job = Job(train_job("--project", project, "--progress", progress, "--batch-sleep", 0.05))
    resumed = Job(train_job("--project", project, "--resume", "latest", "--seed", OTHER_SEED, "--wait-for", go,
                            "--result", tmp_path / "resumed.st"))
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and int(progress.read_text() or 0) >= 4):
            assert job.running() and time.monotonic() < deadline, job.wait(expect=None).output[-3000:]
            time.sleep(0.01)
        job.kill(signal.SIGTERM)
        job.wait(expect=PREEMPTION_EXIT_CODE)
        assert "Preempted: saved" in job.output
        saved = run_checkpoints(project)
        assert len(saved) == 1, saved
        state = torch.load(saved[0] / "custom_checkpoint_0.pt", weights_only=True)  # the TrainState
        assert 4 <= state["global_step"] < 15
        go.touch()
        resumed.wait()
    finally:
        job.kill_group()
        resumed.kill_group()
    assert_bitwise_equal(tmp_path / "resumed.st", resume_references.get("single_w0"))
    assert load_summary(tmp_path / "resumed.st")["losses"] == load_summary(resume_references.get("single_w0"))["losses"]


class _SignalAt(Callback):
    """Sends `sig` to this very process after the given optimizer step."""

    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig, self.sent = step, sig, False

    def on_train_batch_end(self, trainer) -> None:
        if trainer.state.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)


class _Fail(Callback):
    def on_train_batch_end(self, trainer) -> None:
        raise RuntimeError("boom")


def _handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}


@pytest.fixture
def custom_handlers():
    """Installs recognisable handlers for SIGTERM and SIGUSR1, and puts the originals back after."""
    original = _handlers()
    mine = {signal.SIGTERM: lambda *a: None, signal.SIGUSR1: lambda *a: None}
    for sig, handler in mine.items():
        signal.signal(sig, handler)
    yield mine
    for sig, handler in original.items():
        signal.signal(sig, handler)


def _fit(job, tmp_path, callbacks, **trainer_kwargs) -> Trainer:
    """One epoch of train_job.py's model in this process: 10 batches, 5 optimizer steps."""
    train = DataLoader(job.NoisyDataset(40, augment=True), batch_size=4, shuffle=True)
    trainer = Trainer(callbacks=callbacks, max_epochs=1, gradient_accumulation_steps=2, project_dir=tmp_path,
                      **trainer_kwargs)
    trainer.fit(job.Net(), train)
    return trainer


def test_fit_restores_previous_signal_handlers(tmp_path, train_job_module, custom_handlers):
    _fit(train_job_module, tmp_path / "ok", [])
    assert _handlers() == custom_handlers
    with pytest.raises(RuntimeError, match="boom"):
        _fit(train_job_module, tmp_path / "failed", [_Fail()])
    assert _handlers() == custom_handlers
    with pytest.raises(SystemExit) as exit_info:  # preempted in this process: save, then exit 75
        _fit(train_job_module, tmp_path / "preempted", [_SignalAt(2, signal.SIGTERM)])
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    assert _handlers() == custom_handlers
    assert len(run_checkpoints(tmp_path / "preempted")) == 1


def test_preemption_signals_are_configurable(tmp_path, train_job_module, custom_handlers):
    with pytest.raises(SystemExit) as exit_info:
        _fit(train_job_module, tmp_path / "usr1", [_SignalAt(2, signal.SIGUSR1)], preemption_signals=("SIGUSR1",))
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    # With preemption off, SIGUSR1 reaches the handler that was installed before fit.
    received = SimpleNamespace(count=0)
    signal.signal(signal.SIGUSR1, lambda *a: setattr(received, "count", received.count + 1))
    trainer = _fit(train_job_module, tmp_path / "off", [_SignalAt(2, signal.SIGUSR1)], preemption_signals=())
    assert received.count == 1 and trainer.state.global_step == 5
    assert not run_checkpoints(tmp_path / "off")
    with pytest.raises(ValueError, match="preemption_signals"):
        Trainer(preemption_signals=("SIGNOPE",))


def test_after_a_multi_process_preemption_default_handlers_become_ignore(custom_handlers):
    """A rank exiting 75 ignores a further SIGTERM (torchrun's to the survivors) instead of dying of it;
    a handler the program installed itself is still restored."""
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with PreemptionWatcher() as watcher:
        watcher.mark_exiting(multi_process=True)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is custom_handlers[signal.SIGTERM]
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    with PreemptionWatcher() as watcher:
        watcher.mark_exiting(multi_process=False)  # one process: nobody signals it again
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


class _SignalGroupAt(Callback):
    """After the given optimizer step, sends SIGTERM to this process and its DataLoader workers,
    as a scheduler that signals the whole process group does (without touching other children)."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_train_batch_end(self, trainer) -> None:
        if trainer.state.global_step == self.step and not self.sent:
            self.sent = True
            workers = multiprocessing.active_children()
            assert workers, "the loader should have worker processes"
            # Sent by another process, as a scheduler's signal is: torch's workers exit quietly
            # on a SIGTERM from their own parent, but die on anyone else's.
            pids = [os.getpid(), *(w.pid for w in workers)]
            subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)


def _fit_with_workers(job, tmp_path, worker_init_fn=None) -> None:
    train = DataLoader(job.NoisyDataset(40, augment=True), batch_size=4, shuffle=True, num_workers=2,
                       worker_init_fn=worker_init_fn)
    Trainer(callbacks=[_SignalGroupAt(2)], max_epochs=1, gradient_accumulation_steps=2,
            project_dir=tmp_path).fit(job.Net(), train)


def test_group_sigterm_with_workers_saves_when_workers_ignore_it(tmp_path, train_job_module):
    """The documented workaround: workers that ignore the preemption signals keep serving batches."""
    with pytest.raises(SystemExit) as exit_info:
        _fit_with_workers(train_job_module, tmp_path, worker_init_fn=ignore_preemption_signals)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    assert len(run_checkpoints(tmp_path)) == 1


def test_group_sigterm_with_workers_saves(tmp_path, train_job_module):
    with pytest.raises(SystemExit) as exit_info:
        _fit_with_workers(train_job_module, tmp_path)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE


def test_preemption_with_a_users_accelerator_saves_where_latest_looks(tmp_path, train_job_module):
    """A pre-built Accelerator without a project or automatic naming: the preemption save still
    lands in the run's folder under {project_dir}/checkpoints, and resume_from="latest" finds it there."""
    from fittrain import Accelerator

    job = train_job_module
    train = DataLoader(job.NoisyDataset(40, augment=True), batch_size=4, shuffle=True)
    with pytest.raises(SystemExit) as exit_info:
        Trainer(callbacks=[_SignalAt(2, signal.SIGTERM)], max_epochs=1, project_dir=tmp_path,
                accelerator=Accelerator(gradient_accumulation_steps=2)).fit(job.Net(), train)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    assert [p.name for p in run_checkpoints(tmp_path)] == ["checkpoint_0"]
    resumed = Trainer(max_epochs=1, project_dir=tmp_path, resume_from="latest",
                      accelerator=Accelerator(gradient_accumulation_steps=2))
    resumed.fit(job.Net(), train)
    assert resumed.state.global_step == 5


def test_preemption_saves_even_after_a_failed_background_write(tmp_path, train_job_module, monkeypatch):
    """An async checkpoint whose write fails does not stop the preemption save: it is reported
    as a warning, and the preemption checkpoint lands."""
    from fittrain.callbacks import Checkpointer
    from fittrain.checkpoint import snapshot as snapshot_module

    original, calls = snapshot_module.write_snapshot, []

    def first_write_fails(writer, snapshot):  # type: ignore[no-untyped-def]
        calls.append(snapshot)
        if len(calls) == 1:
            raise OSError(28, "No space left on device (injected)")
        original(writer, snapshot)

    monkeypatch.setattr(snapshot_module, "write_snapshot", first_write_fails)
    callbacks = [Checkpointer(every_n_steps=1, async_save=True), _SignalAt(1, signal.SIGTERM)]
    with pytest.warns(UserWarning, match="background checkpoint write had failed.*No space left"):
        with pytest.raises(SystemExit) as exit_info:
            _fit(train_job_module, tmp_path, callbacks)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE and len(calls) == 2
    assert [p.name for p in run_checkpoints(tmp_path)] == ["checkpoint_1"]


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (for torchrun: its worker processes), from Linux's /proc."""
    listing = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    if not listing.exists():
        pytest.skip("needs /proc/<pid>/task/<pid>/children (Linux) to find torchrun's workers")
    return [int(child) for child in listing.read_text().split()]


def _worker_exit_codes(torchrun_output: str) -> dict[int, int]:
    """Each failed worker's exit code, from the summary torchrun prints when a worker exits non-zero
    (after stopping the others it lists every worker that ended non-zero, SIGTERM deaths as -15)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", torchrun_output)
    return {int(rank): int(code) for rank, code in found}


def test_sigterm_in_a_two_process_run_exits_75_on_every_rank(tmp_path):
    """SIGTERM to one worker of a 2-process torchrun job: both ranks save one checkpoint together
    and every rank exits 75. Rank 1 lingers on its way out, so torchrun, which signals the ranks still
    alive as soon as rank 0 has exited, always hits it during its teardown: it must exit 75, not -15."""
    project, progress = tmp_path / "run", tmp_path / "progress"
    # 400 samples, batch 4, 2 ranks, accumulation 2: 25 optimizer steps per epoch. The ranks agree
    # on a stop every 10 steps (PreemptionWatcher.check_every), so the save lands at step 10 or 20.
    job = Job(torchrun(2, TRAIN_JOB, "--project", project, "--progress", progress, "--batch-sleep", 0.05,
                       "--samples", 400, "--patience", 100, "--exit-linger", 2))
    try:
        deadline = time.monotonic() + 120
        while not (progress.exists() and int(progress.read_text() or 0) >= 3):
            assert job.running() and time.monotonic() < deadline, job.wait(expect=None).output[-3000:]
            time.sleep(0.01)
        workers = _children(job.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGTERM)
        job.wait(expect=None)
    finally:
        job.kill_group()
    assert _worker_exit_codes(job.output) == {0: PREEMPTION_EXIT_CODE, 1: PREEMPTION_EXIT_CODE}, job.output[-4000:]
    saved = run_checkpoints(project)
    assert len(saved) == 1, saved
    state = torch.load(saved[0] / "custom_checkpoint_0.pt", weights_only=True)  # the TrainState
    assert state["global_step"] in (10, 20), state
