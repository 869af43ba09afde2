"""The test tree's one rule that pytest enforces only by failing to collect: test modules are imported
as top-level modules (tests/README.md), so no two of them may share a basename."""

from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(path.relative_to(TESTS).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"test modules sharing a basename (rename one of each): {shared}"
