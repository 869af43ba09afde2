"""The test harness itself (tests/support/shared.py): a session fixture's folder is filled once for
every pytest-xdist worker, and a fill that raised is made again, not half-kept."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest

from support.shared import shared_folder


@pytest.fixture
def as_a_worker(tmp_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory,
                monkeypatch: pytest.MonkeyPatch) -> pytest.TempPathFactory:
    """`tmp_path_factory` as an xdist worker sees it, with this test's folder as the run's folder."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(tmp_path_factory, "getbasetemp", lambda: tmp_path / "popen-gw0")
    return tmp_path_factory


def test_workers_asking_at_once_get_one_folder_filled_once(as_a_worker: pytest.TempPathFactory) -> None:
    fills: list[pathlib.Path] = []

    def fill(folder: pathlib.Path) -> None:
        fills.append(folder)
        time.sleep(0.3)  # long enough for the other workers to be waiting on the lock
        (folder / "result.txt").write_text("done")

    got: list[pathlib.Path] = []
    workers = [threading.Thread(target=lambda: got.append(shared_folder(as_a_worker, "job", fill)))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert len(got) == 3 and len(set(got)) == 1 and fills == got[:1]
    assert (got[0] / "result.txt").read_text() == "done"


def test_a_fill_that_raised_leaves_nothing_and_the_next_worker_fills_anew(
        as_a_worker: pytest.TempPathFactory) -> None:
    def broken(folder: pathlib.Path) -> None:
        (folder / "partial.txt").write_text("half")
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        shared_folder(as_a_worker, "job", broken)
    folder = shared_folder(as_a_worker, "job", lambda f: (f / "result.txt").write_text("done"))
    assert sorted(p.name for p in folder.iterdir()) == ["result.txt"]
