"""The `fittrain` command line, failing jobs, collective timeouts and a 2-node rendezvous.

The command-line tests run `fittrain.launch.cli.main` in this process; the job tests start real
torchrun / `fittrain launch` jobs on gloo.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import socket
import sys

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from fittrain.launch import cli
from support.jobs import SCRIPTS, fittrain_launch, free_port, job_env, run, run_together, torchrun
from support.results import assert_state_close, assert_state_equal, read_results

pytestmark = pytest.mark.subprocess

#: A failing job must end within this after the failure (torchrun polls its workers every 0.1 s
#: and gives survivors a grace period after SIGTERM); startup time on a busy machine is excluded.
BOUND_SECONDS = 30.0


# ----------------------------------------------------------------- the command line, in process
def test_bare_fittrain_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fittrain") and "launch" in out and "env" in out


def test_help_explains_commands_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert "examples:" in capsys.readouterr().out


def test_launch_help_lists_options_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    out = capsys.readouterr().out
    for option in ("--num_processes", "--nnodes", "--node_rank", "--main_process_ip", "--main_process_port",
                   "--strategy {auto,ddp,fsdp}", "examples:", "fittrain launch --num_processes 2 train.py"):
        assert option in out


def test_env_reports_versions_devices_and_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for field in ("fittrain version: 0.1.0", f"torch version: {torch.__version__}", "Python version:",
                  "Platform:", "CPU count:", "CUDA available:", "MPS available:", "gloo yes"):
        assert field in out


def test_console_script_points_at_cli_main() -> None:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="fittrain")
    assert entry.load() is cli.main


def _torchrun_argv(*argv: str) -> list[str]:
    args = cli.build_parser().parse_args(["launch", *argv])
    return cli.torchrun_argv(args, args.parser)


@pytest.fixture
def script(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return "train.py"


def test_launch_translates_options_to_torchrun(script: str) -> None:
    argv = _torchrun_argv("--num_processes", "4", "--nnodes", "2", "--node_rank", "1", "--main_process_ip",
                          "10.0.0.1", "--main_process_port", "1234", script, "--lr", "3", "--nnodes", "9")
    assert argv == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "10.0.0.1",
                    "--master-port", "1234", "train.py", "--lr", "3", "--nnodes", "9"]


def test_launch_on_one_machine_leaves_the_port_to_torchrun() -> None:
    assert _torchrun_argv("--num_processes", "2", "-m", "pkg.train") == [
        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2", "--module", "pkg.train"]


@pytest.mark.parametrize("argv, message", [
    (["--num_processes", "3", "--nnodes", "2"], "must divide by --nnodes. Received: --num_processes 3 --nnodes 2"),
    (["--num_processes", "0"], "at least 1. Received: --num_processes 0"),
    (["--nnodes", "2", "--node_rank", "2", "--num_processes", "2"], "Received: --node_rank 2"),
    (["--strategy", "zero"], "invalid choice: 'zero'"),
    (["--num_processes", "2", "missing.py"], "'missing.py' does not exist"),
])
def test_launch_rejects_bad_layouts(argv: list[str], message: str, script: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", *argv, script])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def _failure(rank_exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=rank_exitcode, error_file="<N/A>")
    failure.timestamp = timestamp
    return failure


def test_exit_code_is_the_first_failing_ranks() -> None:
    # The launcher's own SIGTERM to the survivors, stamped in the same second, never wins.
    same_second = ChildFailedError("job", {0: _failure(-15, 100), 1: _failure(3, 100)})
    assert cli.exit_code(same_second) == 3
    earlier_signal = ChildFailedError("job", {0: _failure(-9, 99), 1: _failure(3, 100)})
    assert cli.exit_code(earlier_signal) == 128 + 9
    assert cli.exit_code(SignalException("stop", 2)) == 130


# ----------------------------------------------------------------- real jobs
def test_a_rank_that_raises_ends_the_job_with_its_exit_code() -> None:
    job = run(fittrain_launch(2, "fail_worker.py", "raise"))
    assert job.returncode == 1, job.output[-4000:]
    raised_at = float(re.search(r"rank 1 raises at ([\d.]+)", job.output).group(1))
    assert job.ended_at - raised_at < BOUND_SECONDS, job.output[-4000:]
    assert "rank 1 fails on purpose" in job.output
    assert "passed a barrier" not in job.output


def test_a_collective_with_an_absent_peer_times_out() -> None:
    env = job_env(FITTRAIN_COLLECTIVE_TIMEOUT="3")
    job = run(fittrain_launch(2, "fail_worker.py", "stall"), env=env)
    assert job.returncode == 7, job.output[-4000:]  # rank 0's own exit code ends the job
    found = re.search(r"collective failed after ([\d.]+)s, at ([\d.]+)", job.output)
    waited, failed_at = float(found.group(1)), float(found.group(2))
    assert 2.5 <= waited < BOUND_SECONDS, job.output[-4000:]
    assert job.ended_at - failed_at < BOUND_SECONDS  # rank 1, asleep for 600 s, was stopped


def test_loaders_of_different_lengths_fail_at_once_on_every_rank() -> None:
    job = run(fittrain_launch(2, "fail_worker.py", "uneven")).check()
    for rank in (0, 1):
        for where, unit in (("prepare", "samples"), ("fit", "batches")):
            line = re.search(rf"rank {rank} {where}: (.*)", job.output)
            assert line, job.output[-4000:]
            assert f"process 0: {16 if unit == 'samples' else 4} {unit}" in line.group(1)
            assert f"process 1: {12 if unit == 'samples' else 3} {unit}" in line.group(1)
    if sys.platform == "linux":
        # The group, DDP's included, was really destroyed before finalization: its threads were joined.
        assert job.output.count("at exit: gloo_threads=[]") == 2, job.output[-4000:]


def test_a_script_without_end_training_leaves_nothing_running_at_exit(tmp_path: pathlib.Path) -> None:
    """fittrain destroys its process groups and lands a background checkpoint before the interpreter
    finalizes (see fittrain.distributed.teardown), so no gloo or writer thread is left to crash the exit."""
    job = run(torchrun(2, "exit_worker.py", str(tmp_path))).check()
    for rank in (0, 1):
        assert f"at exit: rank {rank} group_alive=False threads=[]" in job.output, job.output[-4000:]
    from fittrain.checkpoint import is_intact

    assert is_intact(tmp_path / "checkpoints" / "checkpoint_0")


def test_two_nodes_rendezvous_on_localhost(tmp_path: pathlib.Path,
                                           one_process_references: dict[str, dict[str, torch.Tensor]]) -> None:
    port = free_port()
    nodes = run_together([[*_node_command(node_rank, port), str(SCRIPTS / "ddp_worker.py"), "--out", str(tmp_path),
                           "--scenarios", "facts,ddp_runs,end_training"] for node_rank in (0, 1)])
    for node in nodes:
        node.check()
    ranks = read_results(tmp_path, 2)
    for r, rank in enumerate(ranks):
        facts = rank["facts"]
        assert (facts["num_processes"], facts["process_index"], facts["local_process_index"]) == (2, r, 0)
        assert facts["group_rank"] == str(r)  # the node rank
        assert facts["is_local_main_process"] and facts["is_main_process"] == (r == 0)
    assert_state_equal(ranks[1]["ddp_runs"]["plain"]["params"], ranks[0]["ddp_runs"]["plain"]["params"])
    assert_state_close(ranks[0]["ddp_runs"]["plain"]["params"], one_process_references["plain"], atol=1e-6)


def _node_command(node_rank: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def test_a_job_whose_port_was_taken_runs_again_on_a_fresh_port() -> None:
    """The test helper's guard against the free-port race: the port is taken for real here."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        job = run(torchrun(2, "hello_worker.py", port=taken.getsockname()[1])).check()
    assert sorted(re.findall(r"rank \d ok", job.output)) == ["rank 0 ok", "rank 1 ok"]
