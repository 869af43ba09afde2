"""Suite-wide: the `subprocess` marker, the guard every test runs under, and the CPU as the device.

`subprocess` marks the tests that start processes (torchrun and `fittrain launch` jobs, forked
ranks, fresh interpreters): they are most of the suite's time, so `python -m pytest -m "not
subprocess"` is the quick inner loop, and the README's `python -m pytest -q` still runs everything.
A file whose every test starts processes says so at its top (`pytestmark = pytest.mark.subprocess`);
a test elsewhere that starts one carries `@pytest.mark.subprocess` itself. The guard fails an
unmarked test that starts a new Python interpreter or forks a job's ranks (tests/support/ranks.py
raises an audit event for each), so the quick loop never pays for one unnoticed (a short `git` or
`mount` is not worth a mark).

The guard (`guard`, autouse) also restores the environment variables a test changed, ends the
jobs (tests/support/jobs.py) a test left running, and fails a test that leaves a torch process
group initialized or another child process running, after ending them, so that one test's
leftovers never change the next one's result.

CUDA is hidden from the suite (`TEST_CUDA` below) unless `FITTRAIN_TEST_CUDA=1`, which tests/gpu needs.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
from typing import Iterator

import pytest

#: The suite runs on the CPU wherever it runs, as CI does: its comparisons (bitwise with a hand loop, with
#: Lightning and Accelerate on "cpu") hold for one device, and its 2-process jobs use gloo. So CUDA is
#: hidden here, before anything initializes it, from this process and every process a test starts.
#: tests/gpu holds the CUDA checks: on a GPU machine, `FITTRAIN_TEST_CUDA=1 python -m pytest tests/gpu`.
TEST_CUDA = "FITTRAIN_TEST_CUDA"
if os.environ.get(TEST_CUDA) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

#: Fixtures that tests in several folders share (folder conftests hold those of one folder).
pytest_plugins = ["support.training_fixtures"]
#: A process whose environment has this variable may outlive the test that started it (the
#: forkserver of tests/support/ranks.py, the resume suite's session-long references job).
SESSION_PROCESS = "FITTRAIN_TEST_SESSION_PROCESS"
#: Audit events that start a new program (a fork alone, as DataLoader workers do, is cheap).
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec"})
#: The audit event of a job of forked ranks (tests/support/ranks.py's AUDIT_EVENT): each rank runs a
#: whole script, as a new interpreter would, without the import.
_RANKS_EVENT = "fittrain.tests.ranks"


_started_key = pytest.StashKey[list]()


#: Most workers `-n auto` starts: each holds a forkserver with torch imported and runs multi-process
#: jobs of its own, so a many-core machine gains little past this and pays in memory.
MAX_WORKERS = 8
#: Workers per core. The suite waits more than it computes (jobs starting, ranks meeting, watchdogs
#: and signal tests waiting out their bounds): on 2 cores, 2 workers kept ~1.2 cores busy. Measured
#: on the 2-core machine (2026-12-03, whole suite): 2 workers 1228 s, 3 workers 1067 s, 4 workers
#: 884 s using 1.46 cores.
WORKERS_PER_CORE = 2


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject.toml's addopts): `WORKERS_PER_CORE` workers per core this process may run
    on, at most `MAX_WORKERS`: 4 on the 2-core machine, so that one worker's waits overlap the
    others' work."""
    return max(1, min(WORKERS_PER_CORE * len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the tests marked `slow` (tens of seconds each) first, in their collected order: under
    xdist each starts early on some worker while the short tests fill the others, instead of one
    arriving last and leaving the other workers idle until it ends. Deterministic, as xdist needs:
    every worker collects the same order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_started_key] = []
    sys.addaudithook(lambda event, args: _record(config, event, args))


def _record(config: pytest.Config, event: str, args: tuple) -> None:
    """Notes a new Python interpreter (what costs seconds: it imports torch) or a job of forked ranks;
    `mount` or `git` do not count."""
    if event == _RANKS_EVENT or (
            event in _PROCESS_EVENTS and _is_python(args[0] if args[0] is not None else _first(args[1]))):
        config.stash[_started_key].append(f"{event}{args[:2]!r}"[:300])


def _first(argv: object) -> object:
    return argv[0] if isinstance(argv, (list, tuple)) and argv else argv


def _is_python(program: object) -> bool:
    name = os.path.basename(os.fsdecode(program)) if isinstance(program, (str, bytes, os.PathLike)) else ""
    return name.startswith("python") or name in ("torchrun", "fittrain", "accelerate", "pytest")


def _children() -> set[int]:
    """The pids of this process's live children (Linux: /proc/self/task/*/children)."""
    pids: set[int] = set()
    for task in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


def _may_stay(pid: int) -> bool:
    """Whether a child may outlive the test: a session process, or one that already ended (a
    zombie whose owner has not waited for it yet)."""
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        state = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
        environ = proc.joinpath("environ").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return True
    return state in ("Z", "X") or f"{SESSION_PROCESS}=1".encode() in environ


def _end(pid: int) -> None:
    """Kills a leftover child and the process group it leads, then reaps it."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)


def _end_jobs() -> None:
    """Ends the jobs of tests/support/jobs.py that the test left running (a failure half-way
    leaves its background jobs behind); such a job is not a failure of its own."""
    jobs = sys.modules.get("support.jobs")  # only a test that imported it can have started one
    if jobs is not None:
        jobs.Job.kill_leftovers()


def _leave_process_group() -> bool:
    """Destroys a process group left initialized; returns whether there was one."""
    dist = sys.modules.get("torch.distributed")  # only a test that imported it can have left a group
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True


def _restore(environ: dict[str, str]) -> None:
    """Puts os.environ back as it was, touching only the variables that changed."""
    for key in [key for key in os.environ if key not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Restores os.environ; ends and reports a leftover process group or child process, and a
    new interpreter started by a test not marked `subprocess`."""
    environ, children = dict(os.environ), _children()
    started = request.config.stash[_started_key]
    started.clear()
    yield
    problems = []
    if started and request.node.get_closest_marker("subprocess") is None:
        problems.append(f"started a process without @pytest.mark.subprocess: {started[0]}")
    _end_jobs()
    if _leave_process_group():
        problems.append("left a torch.distributed process group initialized (destroyed it)")
    leftovers = sorted(pid for pid in _children() - children if not _may_stay(pid))
    for pid in leftovers:
        _end(pid)
    if leftovers:
        problems.append(f"left child processes running (killed them): {leftovers}")
    _restore(environ)
    if problems:
        pytest.fail("; ".join(problems))
