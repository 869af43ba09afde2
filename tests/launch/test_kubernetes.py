"""Kubernetes' environment contract, simulated on this machine as tests/distributed/test_slurm_ddp.py
simulates SLURM's: two "pods", each a process started with only the variables Kubeflow gives it.

- **TrainJob** (Kubeflow Trainer) and **PyTorchJob with `nprocPerNode`** run torchrun in every pod
  with torchrun's `PET_*` variables (`PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR`, `PET_MASTER_PORT`): here the pod's command is `fittrain launch train.py`,
  which reads them as torchrun would.
- **PyTorchJob without torchrun** runs `python train.py` in every pod with `MASTER_ADDR`,
  `MASTER_PORT`, `WORLD_SIZE` and `RANK` (one process per pod, no `LOCAL_RANK`).

Each rank of the job writes what it learnt (`--facts`): its rank, the world size and the sum of
an all-reduce over every rank, and the job trains to its end.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from support.jobs import Job, free_port, job_env, python_script

pytestmark = pytest.mark.subprocess

SCRIPT = ("--samples", "16", "--epochs", "1")


def _run_pods(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    pods = [Job(command, env, port_retry=False) for command, env in zip(commands, envs)]
    try:
        done = [pod.wait(expect=None) for pod in pods]
    finally:
        for pod in pods:
            pod.kill_group()
    for index, pod in enumerate(done):
        assert pod.returncode == 0, f"pod {index} exited {pod.returncode}:\n{pod.output[-4000:]}"


def _facts(folder: pathlib.Path, world_size: int) -> list[dict[str, object]]:
    facts = [json.loads((folder / f"facts.{rank}.json").read_text()) for rank in range(world_size)]
    assert [f["rank"] for f in facts] == list(range(world_size))
    assert {f["world_size"] for f in facts} == {world_size}
    assert {f["all_reduce_sum"] for f in facts} == {sum(range(1, world_size + 1))}
    return facts


def test_trainjob_pods_running_fittrain_launch_with_torchrun_variables_form_one_job(tmp_path: pathlib.Path) -> None:
    port = free_port()
    envs = [job_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(node), PET_MASTER_ADDR="127.0.0.1",
                    PET_MASTER_PORT=str(port)) for node in (0, 1)]
    command = [sys.executable, "-m", "fittrain", "launch", *python_script("slurm_train.py")[1:], *SCRIPT,
               "--project", str(tmp_path), "--facts", str(tmp_path / "facts.{rank}.json")]
    _run_pods([command, command], envs)
    _facts(tmp_path, 2)


def test_pytorchjob_pods_running_python_with_master_variables_form_one_job(tmp_path: pathlib.Path) -> None:
    port = free_port()
    envs = [job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                    KUBERNETES_SERVICE_HOST="10.96.0.1") for rank in (0, 1)]
    command = python_script("slurm_train.py", *SCRIPT, "--project", tmp_path,
                            "--facts", tmp_path / "facts.{rank}.json")
    _run_pods([command, command], envs)
    facts = _facts(tmp_path, 2)
    assert {f["local_rank"] for f in facts} == {0}  # one process per pod: each is local rank 0
