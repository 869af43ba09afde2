"""Bad input to `fittrain launch` and to the variables it exports: one clear line, no traceback.

Each case names the flag, config key or environment variable, the value received and the fix,
and `fittrain launch` stops with argparse's exit code 2 before starting anything.
"""

from __future__ import annotations

import pathlib

import pytest

from fittrain import Accelerator
from fittrain.accelerator.partial_state import PartialState
from fittrain.launch import cli
from fittrain.launch.config import MIXED_PRECISION_ENV


@pytest.fixture
def folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A working folder holding an (empty) train.py, outside any SLURM or torchrun job."""
    monkeypatch.chdir(tmp_path)
    for name in ("SLURM_JOB_ID", "SLURM_NNODES", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs `fittrain launch argv` in this process; returns its error line after checking exit code 2."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["launch", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, expected", [
    (["--main_process_port", "70000"],
     "--main_process_port must be a TCP port from 1 to 65535. Received: --main_process_port 70000."),
    (["--main_process_port", "-1"], "Received: --main_process_port -1."),
    (["--num_cpu_threads_per_process", "0"],
     "--num_cpu_threads_per_process must be at least 1. Received: --num_cpu_threads_per_process 0."),
    (["--num_cpu_threads_per_process", "-4"], "Received: --num_cpu_threads_per_process -4."),
    (["--max_restarts", "-1"], "--max_restarts must be 0 or more. Received: --max_restarts -1."),
    (["--monitor_interval", "0"], "--monitor_interval must be a positive number of seconds. Received: "
                                  "--monitor_interval 0.0."),
    (["--rdzv_id", "job7"], "--rdzv_id configure a c10d rendezvous. Received: --rdzv_backend static. Add "
                            "--rdzv_backend c10d"),
    (["--nnodes", "two"], "--nnodes takes a number of machines, or MIN:MAX for an elastic job, each at least 1 and "
                          "MIN at most MAX. Received: --nnodes two."),
    (["--nnodes", "0"], "Received: --nnodes 0."),
    (["--nnodes", "3:2"], "Received: --nnodes 3:2."),
    (["--nnodes", "1:2", "--nproc_per_node", "1"], "--nnodes 1:2 (an elastic job) needs torchrun's c10d rendezvous. "
                                                   "Received: --rdzv_backend static. Add --rdzv_backend c10d"),
    (["--nnodes", "1:2", "--num_processes", "4", "--rdzv_backend", "c10d"],
     "an elastic job (--nnodes 1:2) does not fix. Received: --num_processes 4. Pass --nproc_per_node N"),
    (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1. Received: --nproc_per_node 0."),
    (["--nproc_per_node", "2", "--num_processes", "4"],
     "--num_processes and --nproc_per_node both set the number of processes. Received: --num_processes 4 "
     "--nproc_per_node 2."),
])
def test_bad_flags_are_named_with_their_value(argv: list[str], expected: str, folder: pathlib.Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused([*argv, "train.py"], capsys)
    assert line.startswith("fittrain launch: error: ")
    assert expected in line


def test_the_port_message_says_what_to_do(folder: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(["--main_process_port", "70000", "train.py"], capsys)
    assert "29500" in line and "leave it out" in line


@pytest.mark.parametrize("body, expected", [
    ("num_processes: two\n", "sets num_processes='two', which must be a whole number of at least 1"),
    ("num_processes: 2.5\n", "sets num_processes=2.5"),
    ("num_processes: true\n", "sets num_processes=True"),
    ("num_machines: [1, 2]\n", "sets num_machines=[1, 2], which must be a whole number of at least 1"),
    ("machine_rank: -1\n", "sets machine_rank=-1, which must be a whole number of at least 0"),
    ("main_process_port: 70000\n", "sets main_process_port=70000, which must be a TCP port from 1 to 65535"),
    ("main_process_port: http\n", "sets main_process_port='http'"),
])
def test_bad_config_values_are_named_with_key_and_value(body: str, expected: str, folder: pathlib.Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "config.yaml").write_text(f"compute_environment: LOCAL_MACHINE\n{body}")
    line = _refused(["--config_file", "config.yaml", "train.py"], capsys)
    assert "`--config_file config.yaml` " + expected in line, line


def test_config_numbers_written_as_strings_still_work(folder: pathlib.Path) -> None:
    (folder / "config.yaml").write_text("num_processes: '4'\nnum_machines: 2\nmachine_rank: '1'\n"
                                        "main_process_port: '29501'\n")
    args = cli.build_parser().parse_args(["launch", "--config_file", "config.yaml", "train.py"])
    argv = cli.torchrun_argv(args, args.parser)
    assert argv[:6] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2"]
    assert argv[argv.index("--master-port") + 1] == "29501"


@pytest.mark.parametrize("name, body, expected", [
    ("config.yaml", "num_processes: 2\n  mixed_precision: [bf16\n", "is not valid YAML: "),
    ("config.yaml", "a: 'unclosed\n", "is not valid YAML: "),
    ("config.json", '{"num_processes": 2,}', "is not valid JSON: "),
])
def test_a_malformed_config_file_is_named_with_where_it_breaks(name: str, body: str, expected: str,
                                                               folder: pathlib.Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (folder / name).write_text(body)
    line = _refused(["--config_file", name, "train.py"], capsys)
    assert f"`--config_file {name}` {expected}" in line, line
    assert "line " in line and "column " in line and "accelerate config" in line


def test_a_bad_precision_variable_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIXED_PRECISION_ENV, "fp9")
    message = rf"Environment variable {MIXED_PRECISION_ENV} must be one of 'no', 'fp16' or 'bf16'\. Received: " \
              rf"{MIXED_PRECISION_ENV}='fp9'\."
    with pytest.raises(ValueError, match=message) as raised:
        Accelerator()
    assert "mixed_precision=" not in str(raised.value)
    with pytest.raises(ValueError, match=message):
        PartialState()
    Accelerator(mixed_precision="no")  # a value in the script wins over the variable, as in Accelerate


def test_a_config_file_that_is_not_text_is_named(folder: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "config.yaml").write_bytes(b"num_processes: 2\n\xff\xfe\x00")
    line = _refused(["--config_file", "config.yaml", "train.py"], capsys)
    assert "`--config_file config.yaml` is not a text file in UTF-8 (invalid start byte at byte 17)" in line, line


@pytest.mark.parametrize("value", ["'--5'", "'2 2'", "'0x10'"])
def test_odd_number_strings_in_a_config_are_refused_by_name(value: str, folder: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "config.yaml").write_text(f"num_processes: {value}\n")
    line = _refused(["--config_file", "config.yaml", "train.py"], capsys)
    assert "sets num_processes=" in line and "whole number of at least 1" in line, line


@pytest.mark.parametrize("body, expected", [
    ("use_cpu: maybe\n", "sets use_cpu='maybe', which must be true or false"),
    ("debug: 3\n", "sets debug=3, which must be true or false"),
    ("rdzv_backend: etcd\n", "sets rdzv_backend='etcd', which fittrain launch does not run. Use static or c10d"),
])
def test_config_choices_are_checked_not_coerced(body: str, expected: str, folder: pathlib.Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "config.yaml").write_text(body)
    line = _refused(["--config_file", "config.yaml", "train.py"], capsys)
    assert f"`--config_file config.yaml` {expected}" in line, line


def test_config_booleans_as_yaml_writes_them(folder: pathlib.Path) -> None:
    (folder / "config.yaml").write_text("use_cpu: 'false'\ndebug: true\nrdzv_backend: c10d\n")
    args = cli.build_parser().parse_args(["launch", "--config_file", "config.yaml", "train.py"])
    cli.torchrun_argv(args, args.parser)
    assert (args.cpu, args.debug, args.rdzv_backend) == (False, True, "c10d")


def test_restart_and_rendezvous_flags_reach_torchrun_under_its_names(folder: pathlib.Path) -> None:
    args = cli.build_parser().parse_args(
        ["launch", "--num_processes", "2", "--max_restarts", "3", "--monitor_interval", "0.5", "--rdzv_backend",
         "c10d", "--rdzv_endpoint", "10.0.0.1:29400", "--rdzv_id", "job7", "--rdzv_conf", "join_timeout=600",
         "train.py", "--lr", "0.1"])
    argv = cli.torchrun_argv(args, args.parser)
    assert argv == ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2", "--max-restarts", "3",
                    "--monitor-interval", "0.5", "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=600",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400", "train.py", "--lr", "0.1"]
    from torch.distributed import run as torchrun  # torchrun itself reads them as given

    parsed = torchrun.get_args_parser().parse_args(argv)
    assert (parsed.max_restarts, parsed.rdzv_id, parsed.rdzv_endpoint) == (3, "job7", "10.0.0.1:29400")


def test_an_elastic_node_range_reaches_torchrun_with_the_processes_per_machine(folder: pathlib.Path) -> None:
    args = cli.build_parser().parse_args(
        ["launch", "--nnodes", "1:4", "--nproc_per_node", "8", "--rdzv_backend", "c10d", "--rdzv_endpoint",
         "node-0:29400", "train.py"])
    argv = cli.torchrun_argv(args, args.parser)
    assert argv[:6] == ["--nnodes", "1:4", "--node-rank", "0", "--nproc-per-node", "8"]
    from torch.distributed import run as torchrun

    parsed = torchrun.get_args_parser().parse_args(argv)
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_endpoint) == ("1:4", "8", "node-0:29400")
    config = torchrun.config_from_args(parsed)[0]
    assert (config.min_nodes, config.max_nodes) == (1, 4)  # torchrun reads the range as elastic



def test_torchrun_environment_fills_what_flags_do_not_give(folder: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Kubeflow's PyTorchJob and TrainJob set torchrun's PET_ variables for each pod; fittrain launch
    passes explicit flags to torchrun, so it must read them as torchrun does (flags still win)."""
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
                        "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob", "PET_MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["launch", "--max_restarts", "2", "train.py"])
    argv = cli.torchrun_argv(args, args.parser)
    assert argv == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--max-restarts", "2",
                    "--master-addr", "trainjob-node-0-0.trainjob", "--master-port", "29400", "train.py"]
    assert "from torchrun's environment: PET_NNODES=2 PET_NPROC_PER_NODE=4 PET_NODE_RANK=1" in capsys.readouterr().err

    args = cli.build_parser().parse_args(["launch", "--nproc_per_node", "2", "--node_rank", "0", "train.py"])
    assert cli.torchrun_argv(args, args.parser)[:6] == ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"]


def test_an_elastic_range_from_the_environment_keeps_its_minimum(folder: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "8", "PET_RDZV_BACKEND": "c10d",
                        "PET_RDZV_ENDPOINT": "job-master:29400", "PET_MAX_RESTARTS": "5"}.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["launch", "train.py"])
    argv = cli.torchrun_argv(args, args.parser)
    assert argv[:8] == ["--nnodes", "1:3", "--node-rank", "0", "--nproc-per-node", "8", "--max-restarts", "5"]
    assert argv[-5:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "job-master:29400", "train.py"]


@pytest.mark.parametrize("variable, value, expected", [
    ("PET_NPROC_PER_NODE", "four", "PET_NPROC_PER_NODE='four' in the environment (torchrun's default for "
                                   "--nproc_per_node) is not a whole number. Fix or unset PET_NPROC_PER_NODE"),
    ("PET_NNODES", "3:1", "Received: --nnodes 3:1."),
    ("PET_RDZV_BACKEND", "etcd", "PET_RDZV_BACKEND='etcd' in the environment names a rendezvous fittrain launch "
                                 "does not run. Use one of static, c10d."),
])
def test_a_bad_torchrun_variable_is_named(variable: str, value: str, expected: str, folder: pathlib.Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(variable, value)
    assert expected in _refused(["train.py"], capsys)
