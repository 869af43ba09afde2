"""The `fittrain` command: `launch` runs a script on many processes, `env` describes this machine.

`fittrain launch` is a thin layer over `torch.distributed.run` (torchrun): it translates
Accelerate's option names into torchrun's, exports the strategy for the Accelerator, and turns the
first failing rank into the exit code of the whole job. Rendezvous, process supervision and
teardown are torchrun's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import signal
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from fittrain.accelerator.launch_env import ACCUMULATION_ENV, DYNAMO_BACKEND_ENV, MIXED_PRECISION_ENV, USE_CPU_ENV
from fittrain.checkpoint import consolidate
from fittrain.common.version import package_version
from fittrain.distributed import launch_guard, slurm
from fittrain.distributed.parallel import STRATEGIES, STRATEGY_ENV
from fittrain.distributed.preemption import forwarding_to_workers, launcher_signals, torchrun_signal_args
from fittrain.distributed.process_state import TIMEOUT_ENV
from fittrain.launch import config as launch_config
from fittrain.launch import estimate
from fittrain.step.precision import PRECISIONS

_LAUNCH_EXAMPLES = """\
examples:
  fittrain launch --num_processes 2 train.py --lr 3e-4
      two processes on this machine; everything after train.py goes to the script
  fittrain launch --num_processes 8 --strategy fsdp -m mypackage.train
      eight processes sharding the model with FSDP2, running a module
  fittrain launch --num_processes 16 --nnodes 2 --node_rank 0 \\
      --main_process_ip 10.0.0.1 --main_process_port 29500 train.py
      the first of two machines with eight processes each; run the same line on the
      second machine with --node_rank 1
  fittrain launch --nnodes 1:4 --nproc_per_node 8 --rdzv_backend c10d \\
      --rdzv_endpoint node-0:29400 --rdzv_id job-42 --max_restarts 3 train.py
      an elastic job, the same line on every machine: it goes on with 1 to 4 machines,
      and with resume_from='auto' from the newest checkpoint after a restart
  fittrain launch --config_file default_config.yaml train.py
      the processes, strategy and precision that `accelerate config` wrote; flags win
  srun --ntasks-per-node=1 fittrain launch train.py
      under SLURM, once per node: --nnodes, --node_rank, --main_process_ip and
      --main_process_port come from SLURM's variables unless given

The job ends when any process fails, and exits with that process's exit code.
"""

_MAIN_EXAMPLES = """\
examples:
  fittrain launch --num_processes 2 train.py     run train.py on two processes
  fittrain env                                   print versions and devices for a bug report
  fittrain estimate mypkg.models:build           each process's memory for a model (--dp_shard_size N: FSDP2)
  fittrain --version                             print fittrain's and torch's versions
"""

#: Environment variables worth showing in a bug report when they are set.
_REPORTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                 "OMP_NUM_THREADS", STRATEGY_ENV, TIMEOUT_ENV, MIXED_PRECISION_ENV, ACCUMULATION_ENV,
                 DYNAMO_BACKEND_ENV, USE_CPU_ENV, "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                 "SLURM_NODEID", "SLURM_NNODES", "SLURM_NODELIST", slurm.SLURM_ENV, slurm.REQUEUE_ENV)


def _default_num_processes() -> int:
    """One process per visible GPU, as Accelerate's default on a GPU machine; one without GPUs."""
    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    launch = subparsers.add_parser(
        "launch", help="run a training script on one or more processes (wraps torchrun)",
        description="Run a training script on one or more processes, on one or more machines.\n"
                    "A thin layer over torch.distributed.run (torchrun): it sets RANK, WORLD_SIZE,\n"
                    "LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process, which\n"
                    "fittrain.Accelerator reads.",
        epilog=_LAUNCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_argument("--config_file", default=None, metavar="FILE",
                        help="an Accelerate config file (YAML or JSON, as `accelerate config` writes); flags "
                             "given here win over its values")
    launch.add_argument("--num_processes", type=int, default=None, metavar="N",
                        help="total number of processes across all machines (default: one per GPU, or 1)")
    launch.add_argument("--nproc_per_node", type=int, default=None, metavar="N",
                        help="processes on this machine (torchrun's name; instead of --num_processes, which "
                             "counts all machines' and needs a fixed --nnodes)")
    launch.add_argument("--nnodes", "--num_machines", dest="nnodes", default=None, metavar="M|MIN:MAX",
                        help="number of machines taking part (default: 1, or SLURM's node count); MIN:MAX "
                             "with --rdzv_backend c10d: an elastic job that goes on with MIN to MAX machines")
    launch.add_argument("--node_rank", "--machine_rank", dest="node_rank", type=int, default=None, metavar="R",
                        help="rank of this machine, from 0 to nnodes-1 (default: 0, or SLURM_NODEID)")
    launch.add_argument("--main_process_ip", default=None, metavar="IP",
                        help="address of the machine with node_rank 0 (default: 127.0.0.1, or SLURM's first host)")
    launch.add_argument("--main_process_port", type=int, default=None, metavar="PORT",
                        help="free port on the main machine (default: any free port on one machine, "
                             "29500 on several)")
    launch.add_argument("--rdzv_backend", choices=launch_config.RDZV_BACKENDS, default=None,
                        help="torchrun's rendezvous: static (default) or c10d at main_process_ip:port")
    launch.add_argument("--rdzv_endpoint", default=None, metavar="HOST:PORT",
                        help="c10d rendezvous address (default: main_process_ip:main_process_port)")
    launch.add_argument("--rdzv_id", default=None, metavar="ID", help="torchrun's job id for a c10d rendezvous")
    launch.add_argument("--rdzv_conf", default=None, metavar="K=V,...",
                        help="torchrun's rendezvous options, e.g. join_timeout=600")
    launch.add_argument("--max_restarts", type=int, default=None, metavar="N",
                        help="restart every process of this machine up to N times when one fails; with "
                             "resume_from='auto' the run goes on from its newest checkpoint (default: 0)")
    launch.add_argument("--monitor_interval", type=float, default=None, metavar="SECONDS",
                        help="how often torchrun checks its processes (default: torchrun's)")
    launch.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help=f"how to parallelise models; exported as {STRATEGY_ENV} and used by "
                             "Accelerator(strategy='auto') (default: the script's own choice)")
    launch.add_argument("--multi_gpu", "--multi_cpu", dest="strategy", action="store_const", const="ddp",
                        help="Accelerate's name for --strategy ddp")
    launch.add_argument("--use_fsdp", dest="strategy", action="store_const", const="fsdp",
                        help="Accelerate's name for --strategy fsdp")
    launch.add_argument("--mixed_precision", choices=PRECISIONS, default=None,
                        help=f"exported as {MIXED_PRECISION_ENV}, the default of Accelerator(mixed_precision=...)")
    launch.add_argument("--gradient_accumulation_steps", type=int, default=None, metavar="N",
                        help=f"exported as {ACCUMULATION_ENV}, the default of "
                             "Accelerator(gradient_accumulation_steps=...)")
    launch.add_argument("--dynamo_backend", default=None, metavar="NAME",
                        help=f"exported as {DYNAMO_BACKEND_ENV}, the default of Accelerator(dynamo_backend=...)")
    launch.add_argument("--cpu", action="store_true", default=False,
                        help=f"train on the CPU even with GPUs present (exported as {USE_CPU_ENV})")
    launch.add_argument("--debug", action="store_true", default=False,
                        help="collectives check that every process passes the same shapes first (exported as "
                             "ACCELERATE_DEBUG_MODE): a clear error instead of a hang")
    launch.add_argument("--gpu_ids", default=None, metavar="IDS",
                        help="comma-separated GPUs to use on this machine (exported as CUDA_VISIBLE_DEVICES)")
    launch.add_argument("--num_cpu_threads_per_process", type=int, default=None, metavar="N",
                        help="exported as OMP_NUM_THREADS")
    launch.add_argument("-m", "--module", action="store_true",
                        help="treat the script as a Python module name, as `python -m` does")
    launch.add_argument("script", help="the training script (or module, with -m) to run")
    launch.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed unchanged to the script")
    launch.set_defaults(handler=_run_launch, parser=launch)


def _add_env_parser(subparsers: argparse._SubParsersAction) -> None:
    env = subparsers.add_parser(
        "env", help="print versions, devices and distributed backends, for bug reports",
        description="Print fittrain, torch and Python versions, the platform, CPU count, CUDA/MPS\n"
                    "devices and the available torch.distributed backends. Paste the output into\n"
                    "bug reports.", formatter_class=argparse.RawDescriptionHelpFormatter)
    env.set_defaults(handler=_run_env, parser=env)


def version_line() -> str:
    """What `fittrain --version` prints: fittrain's version (its package metadata's) and torch's."""
    return f"fittrain {package_version()} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    """The `fittrain` argument parser, with `--version` and the `launch`, `env`, `consolidate` and `estimate`
    subcommands."""
    parser = argparse.ArgumentParser(
        prog="fittrain", description="fittrain: train PyTorch models on one or many processes.",
        epilog=_MAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print fittrain's and torch's versions and exit")
    subparsers = parser.add_subparsers(title="commands", metavar="{launch,env,consolidate,estimate}")
    _add_launch_parser(subparsers)
    _add_env_parser(subparsers)
    consolidate.add_parser(subparsers)
    estimate.add_parser(subparsers)
    return parser


def _processes_per_node(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Checks the process layout and splits the total over the machines (parser.error on bad input)."""
    if args.nproc_per_node is not None:
        if args.num_processes is not None:
            parser.error(f"--num_processes and --nproc_per_node both set the number of processes. Received: "
                         f"--num_processes {args.num_processes} --nproc_per_node {args.nproc_per_node}. Pass one: "
                         "--num_processes counts every machine's, --nproc_per_node this machine's.")
        if args.nproc_per_node < 1:
            parser.error(f"--nproc_per_node must be at least 1. Received: --nproc_per_node {args.nproc_per_node}.")
        return args.nproc_per_node
    # Without --num_processes every machine runs one process per GPU it has (or one).
    total = args.num_processes if args.num_processes is not None else _default_num_processes() * max(args.nnodes, 1)
    if total < 1:
        parser.error(f"--num_processes must be at least 1. Received: --num_processes {total}.")
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1. Received: --nnodes {args.nnodes}.")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node_rank must be between 0 and nnodes-1={args.nnodes - 1}. "
                     f"Received: --node_rank {args.node_rank}.")
    if total % args.nnodes:
        parser.error(f"--num_processes counts processes on all machines, so it must divide by --nnodes. "
                     f"Received: --num_processes {total} --nnodes {args.nnodes}. Use a multiple of {args.nnodes}.")
    return total // args.nnodes


def torchrun_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Translates parsed `fittrain launch` options into torchrun's command line.

    Args:
        args: The parsed `launch` options.
        parser: The `launch` parser, which reports invalid combinations.

    Returns:
        The argument list for `torch.distributed.run.main`.
    """
    resolve_options(args, parser)
    if not args.module and not os.path.isfile(args.script):
        # Fail here once, rather than in every worker after the rendezvous.
        parser.error(f"the training script {args.script!r} does not exist. Received: script={args.script!r}. "
                     "Pass a path to a Python file, or use -m for a module name.")
    nnodes = f"{args.min_nnodes}:{args.nnodes}" if args.min_nnodes != args.nnodes else str(args.nnodes)
    argv = ["--nnodes", nnodes, "--node-rank", str(args.node_rank),
            "--nproc-per-node", str(_processes_per_node(args, parser))] + _elastic_flags(args, parser)
    if args.rdzv_backend == "c10d":
        endpoint = args.rdzv_endpoint or f"{args.main_process_ip or '127.0.0.1'}:{args.main_process_port or 29500}"
        return argv + ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint] + _target(args)
    if args.main_process_ip is not None:
        argv += ["--master-addr", args.main_process_ip]
    # Without a port on one machine torchrun picks a free one itself, so two jobs never collide.
    if args.main_process_port is not None:
        argv += ["--master-port", str(args.main_process_port)]
    return argv + _target(args)


def _elastic_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """torchrun's restart and rendezvous options, passed on under torchrun's names (parser.error on bad input)."""
    if args.max_restarts is not None and args.max_restarts < 0:
        parser.error(f"--max_restarts must be 0 or more. Received: --max_restarts {args.max_restarts}.")
    if args.monitor_interval is not None and not args.monitor_interval > 0:
        parser.error(f"--monitor_interval must be a positive number of seconds. Received: --monitor_interval "
                     f"{args.monitor_interval}.")
    c10d_only = [f"--{name}" for name in ("rdzv_endpoint", "rdzv_id", "rdzv_conf") if getattr(args, name) is not None]
    if args.min_nnodes != args.nnodes:
        if args.rdzv_backend != "c10d":
            parser.error(f"--nnodes {args.min_nnodes}:{args.nnodes} (an elastic job) needs torchrun's c10d "
                         f"rendezvous. Received: --rdzv_backend {args.rdzv_backend or 'static'}. Add --rdzv_backend "
                         "c10d --rdzv_endpoint HOST:PORT, the same on every machine.")
        if args.num_processes is not None:
            parser.error(f"--num_processes counts the processes of all machines, which an elastic job "
                         f"(--nnodes {args.min_nnodes}:{args.nnodes}) does not fix. Received: --num_processes "
                         f"{args.num_processes}. Pass --nproc_per_node N, the processes of each machine, instead.")
    if c10d_only and args.rdzv_backend != "c10d":
        parser.error(f"{', '.join(c10d_only)} configure a c10d rendezvous. Received: --rdzv_backend "
                     f"{args.rdzv_backend or 'static'}. Add --rdzv_backend c10d, or leave them out.")
    flags = {"--max-restarts": args.max_restarts, "--monitor-interval": args.monitor_interval,
             "--rdzv-id": args.rdzv_id, "--rdzv-conf": args.rdzv_conf}
    return [part for flag, value in flags.items() if value is not None for part in (flag, str(value))]


def _target(args: argparse.Namespace) -> list[str]:
    """The script (or module) and its arguments, at the end of torchrun's command line."""
    return (["--module"] if args.module else []) + [args.script, *args.script_args]


def resolve_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fills options from `--config_file` (flags win) and the defaults; parser.error on bad input."""
    _check_flags(args, parser)
    if args.config_file is not None:
        try:
            options = launch_config.options_from_config(launch_config.read_config_file(args.config_file),
                                                        args.config_file)
        except (OSError, ValueError, ImportError) as err:
            parser.error(str(err))
        launch_config.merge(args, options)
    _fill_from_torchrun_env(args, parser)
    _fill_from_slurm(args, parser)
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.min_nnodes = args.nnodes if args.min_nnodes is None else args.min_nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    if args.mixed_precision not in (None, *PRECISIONS):
        parser.error(f"mixed_precision must be one of {', '.join(PRECISIONS)}. Received: {args.mixed_precision!r} "
                     f"(from --config_file {args.config_file}). fp8 is not supported; use bf16 or fp16.")


def _check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Checks the numbers given as flags, before a config file or SLURM fills the others (checked there)."""
    _split_nnodes(args, parser)
    port = args.main_process_port
    if port is not None and not 1 <= port <= launch_config.MAX_PORT:
        parser.error(f"--main_process_port must be a TCP port from 1 to {launch_config.MAX_PORT}. "
                     f"Received: --main_process_port {port}. {launch_config.PORT_HINT}")
    threads = args.num_cpu_threads_per_process
    if threads is not None and threads < 1:
        parser.error(f"--num_cpu_threads_per_process must be at least 1. Received: --num_cpu_threads_per_process "
                     f"{threads}. Leave it out to keep torch's default (or OMP_NUM_THREADS).")
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps < 1:
        parser.error("--gradient_accumulation_steps must be a positive integer. "
                     f"Received: --gradient_accumulation_steps {args.gradient_accumulation_steps}.")


#: torchrun reads PET_<FLAG> as the default of --<flag>, and schedulers set them for it (Kubeflow's
#: PyTorchJob and TrainJob): fittrain launch passes explicit flags, so it reads them the same way.
_TORCHRUN_ENV = {"PET_NNODES": "nnodes", "PET_NPROC_PER_NODE": "nproc_per_node", "PET_NODE_RANK": "node_rank",
                 "PET_MASTER_ADDR": "main_process_ip", "PET_MASTER_PORT": "main_process_port",
                 "PET_RDZV_BACKEND": "rdzv_backend", "PET_RDZV_ENDPOINT": "rdzv_endpoint", "PET_RDZV_ID": "rdzv_id",
                 "PET_RDZV_CONF": "rdzv_conf", "PET_MAX_RESTARTS": "max_restarts",
                 "PET_MONITOR_INTERVAL": "monitor_interval"}
_TORCHRUN_ENV_TYPES = {"node_rank": int, "nproc_per_node": int, "main_process_port": int, "max_restarts": int,
                       "monitor_interval": float}


def _fill_from_torchrun_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fills the options that neither flags nor a config file gave from torchrun's PET_ variables
    (parser.error on a value torchrun could not read either)."""
    used = []
    for variable, name in _TORCHRUN_ENV.items():
        value = os.environ.get(variable)
        if value is None or getattr(args, name) is not None:
            continue
        if name == "nproc_per_node" and value in ("gpu", "cpu", "auto"):  # torchrun's "one per device"
            continue
        kind = _TORCHRUN_ENV_TYPES.get(name, str)
        try:
            setattr(args, name, kind(value))
        except ValueError:
            parser.error(f"{variable}={value!r} in the environment (torchrun's default for --{name}) is not "
                         f"{'a whole number' if kind is int else 'a number'}. Fix or unset {variable}, or pass "
                         f"--{name}.")
        used.append(f"{variable}={value}")
    if args.rdzv_backend not in (None, *launch_config.RDZV_BACKENDS):
        parser.error(f"PET_RDZV_BACKEND={args.rdzv_backend!r} in the environment names a rendezvous fittrain launch "
                     f"does not run. Use one of {', '.join(launch_config.RDZV_BACKENDS)}.")
    if used:
        _split_nnodes(args, parser)  # PET_NNODES may be a MIN:MAX range
        print(f"fittrain launch: from torchrun's environment: {' '.join(used)}", file=sys.stderr, flush=True)


def _split_nnodes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`--nnodes M` or torchrun's elastic `MIN:MAX`: sets `nnodes` (the most machines, an int) and
    `min_nnodes` (None unless a range was given) on `args` (parser.error on bad input); a number
    already split is left as it is."""
    args.min_nnodes = getattr(args, "min_nnodes", None)
    if not isinstance(args.nnodes, str):
        return
    given = str(args.nnodes)
    low, _, high = given.partition(":")
    try:
        least, most = int(low), int(high or low)
    except ValueError:
        least = most = 0
    if not 1 <= least <= most:
        parser.error(f"--nnodes takes a number of machines, or MIN:MAX for an elastic job, each at least 1 and MIN "
                     f"at most MAX. Received: --nnodes {given}. For example --nnodes 2, or --nnodes 1:4.")
    args.nnodes, args.min_nnodes = most, (least if high else None)


def _fill_from_slurm(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Under SLURM on several nodes, fills the node layout that neither flags nor config gave.

    A launcher runs once per node (`srun --ntasks-per-node=1 fittrain launch ...`); see
    `fittrain.distributed.slurm.launch_defaults` for which variable gives which option. An explicit
    `--nnodes` that differs from SLURM's node count means the user lays the job out: then
    nothing is filled.
    """
    try:
        options = slurm.launch_defaults()
    except ValueError as err:
        parser.error(str(err))
    if not options or args.nnodes not in (None, options["nnodes"]):
        return
    filled = {name: value for name, value in options.items() if getattr(args, name, None) is None}
    launch_config.merge(args, filled)
    if filled:
        flags = " ".join(f"--{name} {value}" for name, value in filled.items())
        print(f"fittrain launch: from SLURM's environment: {flags}", file=sys.stderr, flush=True)


def _first_failure(error: Any) -> Any:
    """The failure that ended the job, from a ChildFailedError.

    torchrun stamps failures in whole seconds, and when one rank fails it stops the others with
    SIGTERM, usually within the same second. So among the earliest failures, a real exit code
    wins over a signal, and SIGTERM (what the launcher itself sends) comes last.
    """
    def rank(failure: Any) -> tuple[int, int]:
        code = failure.exitcode
        kind = 0 if code > 0 else (2 if code == -signal.SIGTERM else 1)
        return failure.timestamp, kind

    return min(error.failures.values(), key=rank)


def exit_code(error: BaseException) -> int:
    """The shell exit code for a failed job: the first failing rank's, or 128+N for signal N."""
    # torch's elastic launcher: only the launching process needs it, and it is slow to import.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, SignalException):
        return 128 + int(error.sigval)
    if isinstance(error, ChildFailedError) and error.failures:
        code = _first_failure(error).exitcode
        return 128 - code if code < 0 else (code or 1)  # A negative exit code is a signal number.
    return 1


def _run_launch(args: argparse.Namespace) -> int:
    # torch's elastic launcher: only the launching process needs it, and it is slow to import.
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = torchrun_argv(args, args.parser)
    # Inherited by every worker torchrun starts; the guard makes the workers die with this process.
    os.environ.update({**launch_config.worker_environment(args), **launch_guard.launcher_environment()})
    if args.min_nnodes != args.nnodes:
        # torch's c10d rendezvous shares its store with the workers and publishes that store's address
        # only in a launcher's first round: a launcher that joins a running elastic job waits for it
        # until it times out, and the job cannot grow. Without sharing, every round publishes it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    forwarded = launcher_signals()  # SIGUSR1 (SLURM's --signal=USR1@90) and SIGTERM: the workers save
    try:
        with forwarding_to_workers(forwarded):
            torchrun.main(torchrun_signal_args(forwarded) + argv)
    except ChildFailedError as error:
        print(error.format_msg(), file=sys.stderr)
        return exit_code(error)
    except SignalException as error:
        return exit_code(error)
    return 0


def _backends() -> str:
    if not dist.is_available():
        return "none (torch built without torch.distributed)"
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}
    return ", ".join(f"{name} {'yes' if check() else 'no'}" for name, check in checks.items())


def _devices() -> list[str]:
    lines = [f"CUDA available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        lines.append(f"CUDA version: {torch.version.cuda}")
        lines += [f"CUDA device {i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    lines.append(f"MPS available: {bool(mps is not None and mps.is_available())}")
    return lines


def environment_report() -> str:
    """Versions, platform, devices and distributed backends, as a Markdown list for bug reports."""
    lines = [f"fittrain version: {package_version()}",
             f"`fittrain` command: {shutil.which('fittrain') or 'not on PATH'}",
             f"torch version: {torch.__version__}", f"numpy version: {_version_of('numpy')}",
             f"Python version: {platform.python_version()} ({sys.executable})",
             f"Platform: {platform.platform()}", f"CPU count: {os.cpu_count()}", f"System RAM: {_ram()}",
             *_devices(), f"Distributed backends: {_backends()}"]
    lines += [f"{name}={os.environ[name]}" for name in _REPORTED_ENV if name in os.environ]
    report = "\n".join(f"- {line}" for line in lines)
    # As `accelerate env` does: the default config that `fittrain launch --config_file` would be given.
    config = os.path.join(os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "accelerate",
                          "default_config.yaml")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as handle:
            body = "\n".join(f"\t{line}" for line in handle.read().splitlines())
        return f"{report}\n- Accelerate default config ({config}):\n{body}"
    return f"{report}\n- Accelerate default config: not found"


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _ram() -> str:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return "unknown"
    return f"{pages * page_size / 2**30:.2f} GB"


def _run_env(args: argparse.Namespace) -> int:
    print(environment_report())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `fittrain` command line.

    Args:
        argv: The arguments after the program name; default: `sys.argv[1:]`.

    Returns:
        The process exit code: 0 on success, the first failing rank's code for a failed launch.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()  # Bare `fittrain`: show what it can do.
        return 0
    return args.handler(args)
