"""SLURM's environment on one process: host lists, the process's place, `fittrain launch`'s node
layout, and the requeue after a SIGUSR1 preemption (with a fake `scontrol` on PATH).

Multi-process SLURM runs are in tests/distributed/test_slurm_ddp.py.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch

from fittrain import Callback, Trainer
from fittrain.checkpoint.run_folders import run_checkpoints
from fittrain.distributed.preemption import PREEMPTION_EXIT_CODE
from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.slurm import (
    REQUEUE_ENV,
    SLURM_ENV,
    derived_port,
    expand_hostlist,
    launch_defaults,
    requeue,
    requeue_job_id,
    slurm_process,
)
from fittrain.launch import cli
from support.models import Regressor, regression_loader

_CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", SLURM_ENV, REQUEUE_ENV)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*_CLEARED, *(n for n in os.environ if n.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------- host lists
@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("n[001-002]", ["n001", "n002"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a,b[09-10],c", ["a", "b09", "b10", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu[5]", ["gpu5"]),
])
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist, message", [
    ("", "must list host names"), ("node[01-", r"unclosed '\['"), ("node]", "unbalanced brackets"),
    ("node[5-3]", r"malformed range \[5-3\]"), ("node[a-c]", r"malformed range \[a-c\]"), ("a,,b", "host names"),
    ("[1-2]", "host names"), ("node[]", "malformed range"), ("a b", "host names"),
])
def test_malformed_hostlists_are_named(hostlist: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        expand_hostlist(hostlist, "SLURM_NODELIST")
    assert f"Received: SLURM_NODELIST={hostlist!r}" in str(error.value)


# ----------------------------------------------------------------- one srun task
_TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[07-08]",
         "SLURM_JOB_ID": "1234567"}


def test_an_srun_task_reads_rank_world_local_rank_and_the_first_host() -> None:
    task = slurm_process(_TASK)
    assert (task.rank, task.world_size, task.local_rank) == (1, 4, 1)
    assert (task.master_addr, task.master_port) == ("gpu07", 15000 + 4567)
    assert task.init_method == "tcp://gpu07:19567"


def test_derived_port_follows_lightning() -> None:
    assert derived_port("12345678") == 15000 + 5678 and derived_port("7") == 15007


def test_master_variables_win_over_the_job_and_the_step_nodelist_over_the_job_list() -> None:
    assert slurm_process({**_TASK, "MASTER_PORT": "29555"}).master_port == 29555
    assert slurm_process({**_TASK, "MASTER_ADDR": "10.0.0.9"}).master_addr == "10.0.0.9"
    assert slurm_process({**_TASK, "SLURM_STEP_NODELIST": "gpu08"}).master_addr == "gpu08"
    assert slurm_process({**_TASK, "MASTER_ADDR": "fe80::1"}).init_method == "tcp://[fe80::1]:19567"


@pytest.mark.parametrize("extra", [{"RANK": "0"}, {"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0"}, {SLURM_ENV: "0"}])
def test_torchrun_variables_win_and_slurm_can_be_ignored(extra: dict[str, str]) -> None:
    assert slurm_process({**_TASK, **extra}) is None


def test_no_slurm_and_one_task() -> None:
    assert slurm_process({}) is None
    one = slurm_process({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # no host list, job id or port needed
    assert (one.world_size, one.rank, one.master_addr, one.master_port) == (1, 0, None, None)


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID must be a non-negative integer.*Received: SLURM_PROCID='x'.*srun"),
    ({"SLURM_NTASKS": "-2"}, "SLURM_NTASKS must be a non-negative integer.*'-2'"),
    ({"SLURM_LOCALID": "one"}, "SLURM_LOCALID must be.*'one'"),
    ({"SLURM_PROCID": "4"}, "SLURM_PROCID must be below SLURM_NTASKS. Received: SLURM_PROCID=4, SLURM_NTASKS=4"),
    ({"SLURM_NODELIST": "gpu[07-"}, "SLURM_NODELIST has an unclosed"),
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID must be a number.*'abc'.*MASTER_PORT"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a port.*70000"),
    ({SLURM_ENV: "maybe"}, "FITTRAIN_SLURM must be 1 or 0. Received: FITTRAIN_SLURM='maybe'"),
])
def test_malformed_variables_are_named_with_a_fix(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slurm_process({**_TASK, **change})


def test_missing_host_list_and_job_id_are_explained() -> None:
    with pytest.raises(ValueError, match="no host list"):
        slurm_process({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "1"})
    with pytest.raises(ValueError, match="SLURM_JOB_ID, which is not set.*Set MASTER_PORT"):
        slurm_process({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1"})


def test_process_state_under_slurm_with_one_task(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(name, value)
    state = ProcessState.from_environment(cpu=True)
    assert (state.num_processes, state.process_index, state.backend) == (1, 0, None)


def test_process_state_names_a_malformed_slurm_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "x")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        ProcessState.from_environment(cpu=True)


# ----------------------------------------------------------------- fittrain launch, once per node
_NODE = {"SLURM_JOB_ID": "31337", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_NODELIST": "gpu[07-08]"}


def test_launch_defaults_from_slurm() -> None:
    assert launch_defaults(_NODE) == {"nnodes": 2, "node_rank": 1, "main_process_ip": "gpu07",
                                      "main_process_port": 16337}
    assert launch_defaults({**_NODE, "SLURM_NNODES": "", "SLURM_JOB_NUM_NODES": "2"})["nnodes"] == 2
    assert launch_defaults({**_NODE, "MASTER_PORT": "29500"})["main_process_port"] == 29500
    for quiet in ({**_NODE, "SLURM_NNODES": "1"}, {**_NODE, "RANK": "0"}, {**_NODE, SLURM_ENV: "0"},
                  {k: v for k, v in _NODE.items() if k != "SLURM_JOB_ID"}):
        assert launch_defaults(quiet) == {}


def test_launch_under_slurm_needs_one_launcher_per_node() -> None:
    with pytest.raises(ValueError, match="once per node. Received: SLURM_NTASKS=8 tasks on SLURM_NNODES=2 nodes"):
        launch_defaults({**_NODE, "SLURM_NTASKS": "8"})
    with pytest.raises(ValueError, match="SLURM_NODEID must be a non-negative integer.*'first'"):
        launch_defaults({**_NODE, "SLURM_NODEID": "first"})


def _torchrun_argv(tmp_path: pathlib.Path, *argv: str) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text("")
    args = cli.build_parser().parse_args(["launch", *argv, str(script)])
    return cli.torchrun_argv(args, args.parser)[:-1]


def test_fittrain_launch_fills_the_node_layout_from_slurm(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in _NODE.items():
        monkeypatch.setenv(name, value)
    assert _torchrun_argv(tmp_path, "--num_processes", "8") == [
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--master-addr", "gpu07",
        "--master-port", "16337"]
    assert "from SLURM's environment: --nnodes 2 --node_rank 1" in capsys.readouterr().err
    # Flags win; an explicit --nnodes that differs means the user lays the job out alone.
    assert _torchrun_argv(tmp_path, "--num_processes", "8", "--main_process_ip", "10.0.0.1") == [
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--master-addr", "10.0.0.1", "--master-port",
        "16337"]
    assert _torchrun_argv(tmp_path, "--num_processes", "2", "--nnodes", "1") == [
        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2"]
    # Without --num_processes, every node runs one process per GPU (one without GPUs).
    per_node = str(max(torch.cuda.device_count(), 1))
    assert _torchrun_argv(tmp_path)[:6] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", per_node]
    monkeypatch.setenv("SLURM_NTASKS", "16")
    with pytest.raises(SystemExit):
        _torchrun_argv(tmp_path, "--num_processes", "8")
    assert "srun --ntasks-per-node=1 fittrain launch" in capsys.readouterr().err


# ----------------------------------------------------------------- requeue
@pytest.fixture
def scontrol(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """A fake `scontrol` first on PATH that records its arguments; `fail(code, message)` makes it fail."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"

    def behave(code: int = 0, message: str = "") -> None:
        tool.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\necho "{message}" >&2\nexit {code}\n')
        tool.chmod(0o755)

    behave()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return type("Scontrol", (), {"log": log, "fail": staticmethod(behave),
                                 "calls": staticmethod(lambda: log.read_text().splitlines() if log.exists() else [])})


def test_requeue_job_id_and_the_switch() -> None:
    assert requeue_job_id({}) is None
    assert requeue_job_id({"SLURM_JOB_ID": "88"}) == "88"
    assert requeue_job_id({"SLURM_JOB_ID": "90", "SLURM_ARRAY_JOB_ID": "88", "SLURM_ARRAY_TASK_ID": "2"}) == "88_2"
    assert requeue_job_id({"SLURM_JOB_ID": "88", REQUEUE_ENV: "0"}) is None
    with pytest.raises(ValueError, match="FITTRAIN_SLURM_REQUEUE must be 1 or 0. Received: .*'sometimes'"):
        requeue_job_id({"SLURM_JOB_ID": "88", REQUEUE_ENV: "sometimes"})


def test_requeue_runs_scontrol(scontrol, capsys: pytest.CaptureFixture[str]) -> None:
    assert requeue("123") is True
    assert scontrol.calls() == ["requeue 123"]
    assert "Requeued SLURM job 123" in capsys.readouterr().out


def test_a_failing_or_missing_scontrol_is_a_warning(scontrol, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: pathlib.Path) -> None:
    scontrol.fail(1, "Requested operation is presently disabled")
    with pytest.warns(RuntimeWarning, match=r"`scontrol requeue 123` did not requeue the job: it exited with status 1: "
                                            r"Requested operation is presently disabled\..*SBATCH --requeue"):
        assert requeue("123") is False
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.warns(RuntimeWarning, match="scontrol was not found on PATH.*checkpoint is saved"):
        assert requeue("123") is False
    with pytest.warns(RuntimeWarning, match="not a job id"):
        assert requeue("12; rm -rf /") is False


class _SignalAt(Callback):
    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def _preempted_fit(tmp_path: pathlib.Path, sig: int) -> None:
    loader = regression_loader(16, batch_size=2)
    with pytest.raises(SystemExit) as exit_info:
        Trainer(callbacks=[_SignalAt(2, sig)], project_dir=tmp_path).fit(Regressor(), loader)
    assert exit_info.value.code == PREEMPTION_EXIT_CODE
    assert len(run_checkpoints(tmp_path)) == 1


@pytest.mark.parametrize("sig, env, calls", [
    (signal.SIGUSR1, {"SLURM_JOB_ID": "4242"}, ["requeue 4242"]),
    (signal.SIGTERM, {"SLURM_JOB_ID": "4242"}, []),                     # scancel must not come back
    (signal.SIGUSR1, {"SLURM_JOB_ID": "4242", REQUEUE_ENV: "0"}, []),   # switched off
    (signal.SIGUSR1, {}, []),                                           # not under SLURM
])
def test_sigusr1_under_slurm_requeues_after_the_save(sig, env, calls, scontrol, tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _preempted_fit(tmp_path / "run", sig)
    assert scontrol.calls() == calls


def test_a_failing_requeue_keeps_the_checkpoint_and_exit_75(scontrol, tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    scontrol.fail(1, "Invalid job id specified")
    with pytest.warns(RuntimeWarning, match="`scontrol requeue 4242`.*status 1: Invalid job id"):
        _preempted_fit(tmp_path / "run", signal.SIGUSR1)
    assert scontrol.calls() == ["requeue 4242"]


def test_a_malformed_requeue_switch_fails_before_training(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv(REQUEUE_ENV, "sometimes")
    loader = regression_loader(4, batch_size=2)
    trainer = Trainer(project_dir=tmp_path)
    with pytest.raises(ValueError, match="FITTRAIN_SLURM_REQUEUE"):
        trainer.fit(Regressor(), loader)
    assert trainer.state.global_step == 0
