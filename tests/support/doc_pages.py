"""The README's and docs/*.md's ```python blocks, and running one page's blocks as a reader would.

tests/project/test_docs.py runs every page on the CPU; tests/gpu/test_docs_on_cuda.py runs the same
pages where CUDA is visible, so a block that only works on the CPU (a tensor made in
`training_step` without `device=`) is found there.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import warnings
from typing import Iterator

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block in `page`."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(2))
            for m in FENCE.finditer(text) if m.group(1) == "python"]


def page_id(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


#: The pages that have ```python blocks: what `run_page` takes.
RUNNABLE = [p for p in PAGES if python_blocks(p)]


@contextlib.contextmanager
def _isolated_torch() -> Iterator[None]:
    """Restores what a block may change globally: RNG and the deterministic-algorithms flag."""
    rng = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic)


def run_page(page: pathlib.Path, folder: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs `page`'s blocks in order, in one namespace, in `folder`, with the global RNG seeded and
    restored afterwards; fails naming the first block that raises, with its output."""
    monkeypatch.chdir(folder)
    namespace: dict = {"__name__": "__docs__"}
    with _isolated_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        for line, code in python_blocks(page):
            where = f"{page_id(page)}:{line}"
            output = io.StringIO()
            try:
                with contextlib.redirect_stdout(output):
                    exec(compile(code, where, "exec"), namespace)
            except BaseException as err:
                pytest.fail(f"the ```python block at {where} raised {type(err).__name__}: {err}\n"
                            f"--- its output ---\n{output.getvalue()}", pytrace=False)
