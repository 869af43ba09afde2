"""The command line: runs the categories and prints the report (see the package docstring).

The same entry point runs the child roles: ``python -m benchmarks.fault_injection _job ...``
(also under torchrun), ``_worker`` and ``_writer``.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import random
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch

from . import __doc__ as OVERVIEW
from .checks import Outcome, short
from .children import MODULE, Context
from .damaged import damaged_scenarios
from .disk_full import disk_full_category, disk_full_scenarios
from .hostile import hostile_scenarios
from .job import job_main
from .kills import kill_category, sigterm_category
from .sharded import ROLE as SHARDED_ROLE
from .sharded import sharded_files_category, sharded_main
from .sharded_kills import JOB_ROLE as SHARDED_JOB_ROLE
from .sharded_kills import sharded_job_main, sharded_kill_category
from .worker import Plan, worker_category, worker_main
from .writers import writer_main, writers_category

CATEGORIES = ("kill-sync", "kill-async", "disk-full", "damaged", "hostile", "two-writers", "sigterm-rank",
              "sharded-kill", "sharded-files")
#: Problems printed per failed scenario; the rest are counted.
SHOWN_PROBLEMS = 4
Result = list[Outcome] | str  # a string: why the category was skipped

RUNNERS: dict[str, Callable[[Context], Result]] = {
    "kill-sync": lambda ctx: kill_category(ctx, async_save=False),
    "kill-async": lambda ctx: kill_category(ctx, async_save=True),
    "disk-full": disk_full_category,
    "damaged": lambda ctx: worker_category(ctx, "damaged"),
    "hostile": lambda ctx: worker_category(ctx, "hostile"),
    "two-writers": writers_category,
    "sigterm-rank": sigterm_category,
    "sharded-kill": sharded_kill_category,
    "sharded-files": sharded_files_category,
}
#: The categories whose scenarios run inside a worker process.
WORKER_PLANS: dict[str, Plan] = {
    "damaged": damaged_scenarios, "hostile": hostile_scenarios, "disk-full": disk_full_scenarios}
ROLES: dict[str, Callable[[list[str]], None]] = {
    "_job": job_main, "_worker": functools.partial(worker_main, plans=WORKER_PLANS), "_writer": writer_main,
    SHARDED_ROLE: sharded_main, SHARDED_JOB_ROLE: sharded_job_main}


def report(category: str, result: Result, seconds: float) -> str:
    """The category's lines: `survived/tried` (or why it was skipped), then one line per failed scenario."""
    if isinstance(result, str):
        return f"{category:<13} skipped: {result}"
    survived = sum(not o.problems for o in result)
    lines = [f"{category:<13} {survived}/{len(result)} survived ({seconds:.0f} s)"]
    for outcome in (o for o in result if o.problems):
        more = len(outcome.problems) - SHOWN_PROBLEMS
        lines.append(f"  FAIL {outcome.scenario}: {' | '.join(outcome.problems[:SHOWN_PROBLEMS])}"
                     + (f" | (+{more} more)" if more > 0 else ""))
    return "\n".join(lines)


def total(results: dict[str, Result]) -> str:
    ran = [o for r in results.values() if not isinstance(r, str) for o in r]
    skipped = [name for name, r in results.items() if isinstance(r, str)]
    return (f"total: {sum(not o.problems for o in ran)}/{len(ran)} survived"
            + (f" (skipped: {', '.join(skipped)})" if skipped else ""))


def run_category(ctx: Context, category: str) -> Result:
    """Runs one category; an error in the harness itself is printed and counted as a failed scenario."""
    try:
        return RUNNERS[category](ctx)
    except Exception as err:
        traceback.print_exc()
        return [Outcome("(the harness)", [f"the script itself failed: {short(err)}"])]
    finally:
        ctx.kill_all(but_references=True)


def run_all(ctx: Context, categories: list[str]) -> dict[str, Result]:
    """Runs `categories` in order, printing each one's report as it ends; always kills every child."""
    results: dict[str, Result] = {}
    try:
        # The uninterrupted runs go first, in the background, while the other scenarios run.
        if {"kill-sync", "kill-async"} & set(categories):
            ctx.start_reference("single")
        if "sigterm-rank" in categories:
            ctx.start_reference("ddp")
        for category in categories:
            started = time.monotonic()
            results[category] = run_category(ctx, category)
            print(report(category, results[category], time.monotonic() - started), flush=True)
    finally:
        ctx.kill_all()
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=OVERVIEW,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one scenario per category")
    parser.add_argument("--only", action="append", choices=CATEGORIES, metavar="CATEGORY",
                        help=f"run only this category (repeatable): {', '.join(CATEGORIES)}")
    parser.add_argument("--seed", type=int, help="seed of the random kill moments (default: a random one)")
    return parser.parse_args(argv)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the finally blocks: children killed, tmpfs unmounted


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROLES:
        torch.set_num_threads(1)
        ROLES[argv[0]](argv[1:])
        return
    args = parse_args(argv)
    categories = [c for c in CATEGORIES if not args.only or c in args.only]
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"fault injection{' (quick)' if args.quick else ''}: {', '.join(categories)}; seed {seed}", flush=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="fittrain-faults-", ignore_cleanup_errors=True) as tmp:
        results = run_all(Context(pathlib.Path(tmp), args.quick, random.Random(seed)), categories)
    print(total(results), flush=True)


if __name__ == "__main__":
    main()
