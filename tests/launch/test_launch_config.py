"""`fittrain launch` with Accelerate's launch flags and config files.

The config files are the ones `accelerate config` writes (its key names and value spellings);
the options must reach the workers' `Accelerator()`, which reads what the launcher exported as the
defaults of its arguments. The last test runs a real 2-process job.
"""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import pytest

from fittrain import Accelerator
from fittrain.launch import cli
from fittrain.launch.config import ACCUMULATION_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV, worker_environment
from support.jobs import free_port, run

pytestmark = pytest.mark.subprocess

# What `accelerate config` writes for "multi-CPU" on one machine (accelerate 1.x), with bf16.
MULTI_CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""

FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 4
dynamo_config:
  dynamo_backend: INDUCTOR
"""


@pytest.fixture
def folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    return tmp_path


def _launch(*argv: str) -> tuple[list[str], dict[str, str]]:
    args = cli.build_parser().parse_args(["launch", *argv])
    torchrun_argv = cli.torchrun_argv(args, args.parser)
    return torchrun_argv, worker_environment(args)


def test_an_accelerate_multi_cpu_config_sets_processes_strategy_precision_and_cpu(folder: pathlib.Path) -> None:
    (folder / "config.yaml").write_text(MULTI_CPU_CONFIG)
    argv, env = _launch("--config_file", "config.yaml", "train.py", "--lr", "3")
    assert argv == ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2", "train.py", "--lr", "3"]
    assert env == {"FITTRAIN_STRATEGY": "ddp", MIXED_PRECISION_ENV: "bf16", USE_CPU_ENV: "true"}


def test_flags_win_over_the_config_file(folder: pathlib.Path) -> None:
    (folder / "config.yaml").write_text(MULTI_CPU_CONFIG)
    argv, env = _launch("--config_file", "config.yaml", "--num_processes", "1", "--mixed_precision", "fp16",
                        "--gradient_accumulation_steps", "4", "train.py")
    assert argv[argv.index("--nproc-per-node") + 1] == "1"
    assert env[MIXED_PRECISION_ENV] == "fp16" and env[ACCUMULATION_ENV] == "4"


def test_an_fsdp2_config_maps_to_strategy_fsdp_and_its_dynamo_backend(folder: pathlib.Path) -> None:
    (folder / "fsdp.yaml").write_text(FSDP_CONFIG)
    argv, env = _launch("--config_file", "fsdp.yaml", "train.py")
    assert argv[argv.index("--nproc-per-node") + 1] == "4"
    assert env["FITTRAIN_STRATEGY"] == "fsdp" and env["ACCELERATE_DYNAMO_BACKEND"] == "inductor"


def test_a_json_config_and_accelerates_flag_spellings(folder: pathlib.Path) -> None:
    (folder / "config.json").write_text(json.dumps({"distributed_type": "NO", "num_processes": 1}))
    argv, env = _launch("--config_file", "config.json", "--multi_gpu", "--num_machines", "2", "--machine_rank", "1",
                        "--num_processes", "4", "--main_process_ip", "10.0.0.1", "--cpu", "--gpu_ids", "0,1",
                        "--num_cpu_threads_per_process", "3", "train.py")
    assert argv == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "10.0.0.1",
                    "train.py"]
    assert env == {"FITTRAIN_STRATEGY": "ddp", USE_CPU_ENV: "true", "CUDA_VISIBLE_DEVICES": "0,1",
                   "OMP_NUM_THREADS": "3"}


def test_c10d_rendezvous_gets_an_endpoint(folder: pathlib.Path) -> None:
    argv, _ = _launch("--rdzv_backend", "c10d", "--main_process_ip", "10.0.0.2", "--main_process_port", "1234",
                      "train.py")
    assert argv[-5:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.2:1234", "train.py"]


@pytest.mark.parametrize("config, named", [
    ("distributed_type: DEEPSPEED\n", "distributed_type='DEEPSPEED'"),
    ("mixed_precision: fp8\n", "'fp8'"),
    ("fsdp_config:\n  fsdp_offload_params: true\n", "fsdp_config.fsdp_offload_params=True"),
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n", "dynamo_config.dynamo_mode"),
    ("compute_environment: AMAZON_SAGEMAKER\n", "compute_environment='AMAZON_SAGEMAKER'"),
    ("num_gpus_typo: 2\n", "num_gpus_typo=2"),
    ("- a list\n", "mapping"),
])
def test_a_config_fittrain_cannot_honour_is_refused_by_name(folder: pathlib.Path, config: str, named: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "bad.yaml").write_text(config)
    with pytest.raises(SystemExit) as exited:
        _launch("--config_file", "bad.yaml", "train.py")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "bad.yaml" in err


def test_a_missing_config_file_is_named(folder: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _launch("--config_file", "nowhere.yaml", "train.py")
    assert "--config_file 'nowhere.yaml'" in capsys.readouterr().err


def test_the_accelerator_takes_exported_defaults_but_the_script_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIXED_PRECISION_ENV, "bf16")
    monkeypatch.setenv(ACCUMULATION_ENV, "3")
    default = Accelerator(cpu=True)
    assert (default.mixed_precision, default.gradient_accumulation_steps) == ("bf16", 3)
    explicit = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    assert (explicit.mixed_precision, explicit.gradient_accumulation_steps) == ("no", 2)
    monkeypatch.setenv(ACCUMULATION_ENV, "two")
    with pytest.raises(ValueError, match=f"{ACCUMULATION_ENV}='two'"):
        Accelerator(cpu=True)


def test_a_launched_job_sees_the_config_in_every_process(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.yaml").write_text(MULTI_CPU_CONFIG)
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent("""\
        import json, sys
        from fittrain import Accelerator
        acc = Accelerator()
        facts = {"precision": acc.mixed_precision, "accumulation": acc.gradient_accumulation_steps,
                 "strategy": acc.strategy, "processes": acc.num_processes, "device": str(acc.device)}
        with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as out:
            json.dump(facts, out)
        acc.end_training()
        """))
    command = [sys.executable, "-m", "fittrain", "launch", "--main_process_port", str(free_port()), "--config_file",
               str(tmp_path / "config.yaml"), "--gradient_accumulation_steps", "2", str(script), str(tmp_path)]
    run(command).check()
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts == {"precision": "bf16", "accumulation": 2, "strategy": "ddp", "processes": 2, "device": "cpu"}


def test_env_shows_the_accelerate_default_config_and_numpy_and_ram(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert cli.main(["env"]) == 0
    assert "Accelerate default config: not found" in capsys.readouterr().out
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text(MULTI_CPU_CONFIG)
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "\tdistributed_type: MULTI_CPU" in out and "numpy version: " in out and "System RAM: " in out
