"""The worker (the ``_worker`` role): a child that runs one category's in-process scenarios.

The damaged, hostile and disk-full scenarios run inside one Python process (importing torch once),
but a scenario may hang or crash it. So the worker reports each scenario's start and end as
events, the parent gives each scenario `SCENARIO_TIMEOUT_S`, and a worker that hangs or dies is
killed and restarted after the scenario it was in, which counts as failed.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import time
from typing import Any, Callable

from .checks import Outcome, short
from .children import MODULE, Child, Context, emit, role_args

#: Longest one in-process scenario of a worker may take.
SCENARIO_TIMEOUT_S = 40.0
#: Named scenarios, each run in a folder of its own, returning its problems.
Scenarios = dict[str, Callable[[pathlib.Path], list[str]]]
#: A category's scenarios, given the worker's folder and whether the run is --quick.
Plan = Callable[[pathlib.Path, bool], Scenarios]


# ===================================================================== in the worker
def worker_main(argv: list[str], plans: dict[str, Plan]) -> None:
    """Runs one category's scenarios (its plan in `plans`) from --first on, reporting each as events."""
    parser = argparse.ArgumentParser(prog=f"{MODULE} _worker")
    parser.add_argument("category", choices=sorted(plans))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--first", type=int, default=0, help="the index of the first scenario to run")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    scenarios = plans[args.category](workdir, args.quick)
    emit(plan=list(scenarios))
    for index, (name, run) in enumerate(scenarios.items()):
        if index >= args.first:
            emit(start=name)
            emit(end=name, problems=_run_scenario(run, workdir / f"scenario-{index}"))


def _run_scenario(run: Callable[[pathlib.Path], list[str]], scenario_dir: pathlib.Path) -> list[str]:
    try:
        return run(scenario_dir)
    except Exception as err:  # an error that escaped fittrain (or this script) is a finding too
        return [f"escaped: {short(err)}"]
    finally:
        shutil.rmtree(scenario_dir, ignore_errors=True)


# ===================================================================== in the parent
def worker_category(ctx: Context, category: str, workdir: pathlib.Path | None = None, role: str = "_worker",
                    launch: Callable[[list[Any]], list[Any]] = list) -> list[Outcome]:
    """Runs a worker; one that hangs or dies is killed and restarted after the scenario it was in.

    `role` and `launch` (which turns its command line into the one to run, e.g. on 2 ranks with
    `children.on_ranks`) serve workers of other kinds that report the same events.
    """
    workdir = workdir or ctx.folder(category)
    outcomes: dict[str, Outcome] = {}
    plan: list[str] | None = None
    start = 0
    while plan is None or start < len(plan):
        # Each worker gets a folder of its own, removed after it: a killed one may leave files
        # behind (on the tmpfs, a filler that would make the next scenarios fail).
        files = workdir / f"from-{start}"
        args = role_args(role, category, "--dir", files, "--first", start, *(["--quick"] if ctx.quick else []))
        child = ctx.start(launch(args), ctx.folder(f"{category}-worker") / "log")
        plan, current = _follow(child, outcomes)
        shutil.rmtree(files, ignore_errors=True)
        if plan is None:
            return [Outcome("(the worker)", [f"the worker {child.ending()} before listing its scenarios"])]
        if current is None:
            break
        start = plan.index(current) + 1
    return [outcomes.get(name, Outcome(name, ["never ran"])) for name in plan]


def _follow(child: Child, outcomes: dict[str, Outcome]) -> tuple[list[str] | None, str | None]:
    """Collects a worker's results until it ends; returns its plan and the scenario it hung or died in."""
    plan: list[str] | None = None
    current: str | None = None
    seen, last, hung = 0, time.monotonic(), False
    while not hung:
        running = child.running()
        events = child.events()
        for event in events[seen:]:
            last = time.monotonic()
            plan, current = event.get("plan", plan), event.get("start", current)
            if "end" in event:
                outcomes[event["end"]], current = Outcome(event["end"], event["problems"]), None
        seen = len(events)
        if not running:
            break
        # Before its plan the worker is importing torch; after, each scenario has its own deadline.
        hung = time.monotonic() - last > (SCENARIO_TIMEOUT_S if plan is not None else child.timeout)
        time.sleep(0.05)
    if hung:
        child.kill()
        if current is not None:
            outcomes[current] = Outcome(current, [f"hung: no result after {SCENARIO_TIMEOUT_S:.0f} s (killed)"])
    elif current is not None:
        outcomes[current] = Outcome(current, [f"the worker {child.ending()} during this scenario"])
    return plan, current
