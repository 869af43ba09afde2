"""SLURM's environment: who this process is, where rank 0 listens, and how to requeue the job.

A script started by `srun` (one task per GPU) gets no torchrun variables, only SLURM's:
`SLURM_PROCID` (global rank), `SLURM_NTASKS` (world size), `SLURM_LOCALID` (rank on the node)
and `SLURM_NODELIST` (the hosts, in SLURM's compressed form, e.g. "gpu[01-04,07]"). The
Accelerator reads them when torchrun's are absent; rank 0 listens on the first host, at
`MASTER_PORT` or a port derived from `SLURM_JOB_ID` so that every task computes the same one
without talking to the others. `fittrain launch`, run once per node, fills its node layout from
the same variables. Everything here reads an environment mapping and returns values: no state.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

#: Set to 0 to make fittrain ignore SLURM's variables (e.g. one plain `python` in a batch script).
SLURM_ENV = "FITTRAIN_SLURM"
#: Set to 0 to stop a SIGUSR1 preemption under SLURM from requeueing the job.
REQUEUE_ENV = "FITTRAIN_SLURM_REQUEUE"
#: torchrun's per-process variables: when any is set, torchrun (or `fittrain launch`) started us.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
#: Where the host list is read, first found wins: a step's own hosts, then the job's.
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
NUM_NODES_VARIABLES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
#: Derived ports are PORT_BASE + the last four digits of the job id: Lightning's SLURMEnvironment
#: uses the same rule, so a cluster's firewall rules written for Lightning jobs fit fittrain's.
PORT_BASE = 15000
SCONTROL_TIMEOUT = 60.0

_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def _is_off(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value not in _OFF + _ON:
        raise ValueError(f"Environment variable {name} must be 1 or 0. Received: {name}={env[name]!r}. "
                         f"Set {name}=0 to turn it off, or unset it.")
    return value in _OFF


def _int(env: Mapping[str, str], name: str, hint: str, default: int | None = None) -> int:
    """A non-negative integer variable; `default` when unset (None: required)."""
    value = env.get(name, "").strip()
    if not value and default is not None:
        return default
    if not value.isdigit():
        raise ValueError(f"Environment variable {name} must be a non-negative integer, as SLURM sets it. "
                         f"Received: {name}={env.get(name)!r}. {hint}")
    return int(value)


# ----------------------------------------------------------------- host lists
def _expand_ranges(body: str, hostlist: str, variable: str) -> list[str]:
    """The values of one bracket group, e.g. "01-03,07" -> ["01", "02", "03", "07"], padding kept."""
    values = []
    for part in body.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"{variable} has a malformed range [{body}]: each part must be N or N-M with "
                             f"N <= M. Received: {variable}={hostlist!r}. Use SLURM's own value, or a "
                             "comma-separated list of host names.")
        width = len(low)  # SLURM pads every number of a range like its lower bound: n[001-002]
        values += [str(n).zfill(width) for n in range(int(low), int(high or low) + 1)]
    return values


def _split_top_level(hostlist: str, variable: str) -> Iterator[str]:
    """The comma-separated items of a host list, keeping commas inside brackets."""
    depth, start = 0, 0
    for i, char in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"{variable} has unbalanced brackets. Received: {variable}={hostlist!r}. Use "
                             "SLURM's own value, e.g. node[01-04,07].")
        if char == "," and depth == 0:
            yield hostlist[start:i].strip()
            start = i + 1
    if depth:
        raise ValueError(f"{variable} has an unclosed '['. Received: {variable}={hostlist!r}. Use SLURM's own "
                         "value, e.g. node[01-04,07].")


def _expand_item(item: str, hostlist: str, variable: str) -> list[str]:
    """One item, e.g. "rack[1-2]-n[01-02]" -> rack1-n01, rack1-n02, rack2-n01, rack2-n02."""
    match = _BRACKETS.search(item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    tails = _expand_item(tail, hostlist, variable)
    return [head + value + rest for value in _expand_ranges(match.group(1), hostlist, variable) for rest in tails]


def expand_hostlist(hostlist: str, variable: str = "SLURM_NODELIST") -> list[str]:
    """Expands SLURM's compressed host list into host names, in SLURM's order.

    Args:
        hostlist: e.g. "node01", "node[01-04,07]", "gpu-a[1-2],gpu-b3" or "n[001-002]" (zero
            padding is kept).
        variable: The variable it came from, named in errors.

    Returns:
        The host names, e.g. ["node01", "node02", "node03", "node04", "node07"].

    Raises:
        ValueError: for an empty list, unbalanced brackets or a malformed range.
    """
    items = list(_split_top_level(hostlist.strip(), variable))
    if any(not item or item.startswith("[") or any(c.isspace() for c in item) for item in items):
        raise ValueError(f"{variable} must list host names, e.g. node[01-04,07]. Received: {variable}={hostlist!r}. "
                         "Run under srun/sbatch, which set it, or unset it.")
    return [host for item in items for host in _expand_item(item, hostlist, variable)]


def first_host(env: Mapping[str, str]) -> str | None:
    """The first host of the first host-list variable set (see NODELIST_VARIABLES), or None."""
    for name in NODELIST_VARIABLES:
        if env.get(name, "").strip():
            return expand_hostlist(env[name], name)[0]
    return None


def derived_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: PORT_BASE + its last four digits (15000 to 24999).

    Every task of a job computes the same port, and jobs sharing a node differ unless their ids
    end in the same four digits.

    Raises:
        ValueError: when `job_id` is not a number.
    """
    if not job_id.strip().isdigit():
        raise ValueError(f"Environment variable SLURM_JOB_ID must be a number to derive a port from. Received: "
                         f"SLURM_JOB_ID={job_id!r}. Set MASTER_PORT to a free port instead.")
    return PORT_BASE + int(job_id) % 10000


def _port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT", "").strip():
        port = _int(env, "MASTER_PORT", "Set it to a free port, e.g. MASTER_PORT=29500, or unset it to derive "
                                        "one from SLURM_JOB_ID.")
        if not 0 < port < 65536:
            raise ValueError(f"Environment variable MASTER_PORT must be a port between 1 and 65535. Received: "
                             f"MASTER_PORT={port}. Set it to a free port, or unset it.")
        return port
    if not env.get("SLURM_JOB_ID", "").strip():
        raise ValueError("Under SLURM without MASTER_PORT the rendezvous port is derived from SLURM_JOB_ID, "
                         "which is not set. Received: MASTER_PORT and SLURM_JOB_ID unset. Set MASTER_PORT.")
    return derived_port(env["SLURM_JOB_ID"])


# ----------------------------------------------------------------- the library: one srun task
@dataclass(frozen=True)
class SlurmProcess:
    """This process as an srun task sees itself.

    Attributes:
        rank: Global rank (SLURM_PROCID).
        world_size: Number of tasks (SLURM_NTASKS).
        local_rank: Rank on this node (SLURM_LOCALID).
        master_addr: Where rank 0 listens: MASTER_ADDR, else the first SLURM_NODELIST host
            (None for one task, which needs no rendezvous).
        master_port: MASTER_PORT, else derived from SLURM_JOB_ID (None for one task).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None

    @property
    def init_method(self) -> str:
        """torch.distributed's rendezvous URL at rank 0's host and port."""
        host = f"[{self.master_addr}]" if ":" in (self.master_addr or "") else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def slurm_process(env: Mapping[str, str] | None = None) -> SlurmProcess | None:
    """This process's place in a SLURM job step, or None when SLURM does not describe it.

    None when torchrun's variables are set (they win: `fittrain launch` under SLURM), when
    SLURM_PROCID is not set, or when FITTRAIN_SLURM=0.

    Args:
        env: The environment to read; default: `os.environ`.

    Raises:
        ValueError: naming the variable and its value, for a malformed or inconsistent one.
    """
    env = os.environ if env is None else env
    if any(env.get(name, "").strip() for name in TORCHRUN_VARIABLES) or "SLURM_PROCID" not in env:
        return None
    if _is_off(env, SLURM_ENV):
        return None
    hint = f"Start the script with srun, which sets it correctly, or set {SLURM_ENV}=0 to ignore SLURM's variables."
    rank = _int(env, "SLURM_PROCID", hint)
    world_size = _int(env, "SLURM_NTASKS", hint, default=_int(env, "SLURM_NPROCS", hint, default=1))
    local_rank = _int(env, "SLURM_LOCALID", hint, default=0)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"SLURM_PROCID must be below SLURM_NTASKS. Received: SLURM_PROCID={rank}, "
                         f"SLURM_NTASKS={world_size}. {hint}")
    if world_size == 1:
        return SlurmProcess(rank, 1, local_rank, None, None)
    addr = env.get("MASTER_ADDR", "").strip() or first_host(env)
    if addr is None:
        raise ValueError(f"SLURM_NTASKS={world_size} asks for several processes, but no host list "
                         f"({', '.join(NODELIST_VARIABLES)}) nor MASTER_ADDR says where rank 0 runs. {hint}")
    return SlurmProcess(rank, world_size, local_rank, addr, _port(env))


# ----------------------------------------------------------------- `fittrain launch`: one task per node
def launch_defaults(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`fittrain launch` options that SLURM's variables imply, for a launcher run once per node.

    Empty outside SLURM, on one node, when torchrun's variables are set, or with FITTRAIN_SLURM=0.
    Otherwise: nnodes (SLURM_STEP_NUM_NODES, SLURM_NNODES or SLURM_JOB_NUM_NODES), node_rank
    (SLURM_NODEID), main_process_ip (the first host of the host list) and main_process_port
    (MASTER_PORT, else derived from SLURM_JOB_ID).

    Raises:
        ValueError: for a malformed variable, or more than one launcher task per node.
    """
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID") or any(env.get(name, "").strip() for name in TORCHRUN_VARIABLES):
        return {}
    if _is_off(env, SLURM_ENV):
        return {}
    hint = f"Run `srun --ntasks-per-node=1 fittrain launch ...`, pass the option yourself, or set {SLURM_ENV}=0."
    name = next((n for n in NUM_NODES_VARIABLES if env.get(n, "").strip()), None)
    nnodes = 1 if name is None else _int(env, name, hint)
    if nnodes <= 1:
        return {}
    tasks_name = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    tasks = _int(env, tasks_name, hint, default=nnodes)
    if tasks != nnodes:
        raise ValueError(f"`fittrain launch` starts every process of its node itself, so under SLURM it must run "
                         f"once per node. Received: {tasks_name}={tasks} tasks on {name}={nnodes} nodes. Run `srun "
                         "--ntasks-per-node=1 fittrain launch ...`, or run the script itself with srun, one task "
                         "per GPU, without fittrain launch.")
    options: dict[str, Any] = {"nnodes": nnodes, "node_rank": _int(env, "SLURM_NODEID", hint, default=0),
                               "main_process_ip": first_host(env), "main_process_port": _port(env)}
    return {key: value for key, value in options.items() if value is not None}


# ----------------------------------------------------------------- requeue after a preemption save
def requeue_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id `scontrol requeue` takes for this job, or None outside SLURM or with FITTRAIN_SLURM_REQUEUE=0.

    An array task is named ARRAYJOBID_TASKID, as Lightning does.

    Raises:
        ValueError: for a malformed FITTRAIN_SLURM_REQUEUE.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id or _is_off(env, REQUEUE_ENV):
        return None
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
    return f"{array_job}_{array_task}" if array_job and array_task else job_id


def requeue(job_id: str, timeout: float = SCONTROL_TIMEOUT) -> bool:
    """Runs `scontrol requeue JOB_ID`; a failure is a warning, never an exception.

    It runs after the preemption checkpoint is complete, so whatever goes wrong here must not
    lose it: the warning names the command, what happened and how to resume by hand.

    Returns:
        Whether scontrol accepted the requeue.
    """
    command = ["scontrol", "requeue", job_id]
    shown = " ".join(command)
    fix = (f"The checkpoint is saved: requeue by hand (`{shown}`) or submit the job again; it resumes with "
           "resume_from='latest'. Submit with `#SBATCH --requeue` so that SLURM allows requeueing, or set "
           f"{REQUEUE_ENV}=0 to skip this step.")
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        warnings.warn(f"Not requeueing: SLURM_JOB_ID={job_id!r} is not a job id, so `{shown}` cannot work. {fix}",
                      RuntimeWarning, stacklevel=2)
        return False
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        problem = "scontrol was not found on PATH"
    except (OSError, subprocess.TimeoutExpired) as err:
        problem = f"it failed: {err}"
    else:
        if done.returncode == 0:
            print(f"Requeued SLURM job {job_id} (`{shown}`).", flush=True)
            return True
        output = (done.stderr or done.stdout).strip()[-500:]
        problem = f"it exited with status {done.returncode}" + (f": {output}" if output else "")
    warnings.warn(f"`{shown}` did not requeue the job: {problem}. {fix}", RuntimeWarning, stacklevel=2)
    return False
