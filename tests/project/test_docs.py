"""Every ```python block in README.md and docs/*.md runs as it stands.

The blocks of one Markdown file run in order, in one namespace, so a page may build on its
earlier blocks as a reader following it would. Each file starts from a fresh namespace in its own
empty working folder, with the global RNG seeded and restored afterwards. Blocks that are not
meant to run (fragments, shell commands, output) are marked ```text, ```bash and so on.

Relative links in the same files must point at files that exist.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block in `page`."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(2))
            for m in FENCE.finditer(text) if m.group(1) == "python"]


def _page_id(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


@contextlib.contextmanager
def _isolated_torch():
    """Restores what a block may change globally: RNG and the deterministic-algorithms flag."""
    rng = torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_page_id)
def test_python_blocks_run(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    with _isolated_torch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        for line, code in python_blocks(page):
            where = f"{_page_id(page)}:{line}"
            output = io.StringIO()
            try:
                with contextlib.redirect_stdout(output):
                    exec(compile(code, where, "exec"), namespace)
            except BaseException as err:
                pytest.fail(f"the ```python block at {where} raised {type(err).__name__}: {err}\n"
                            f"--- its output ---\n{output.getvalue()}", pytrace=False)


def test_no_unlabelled_code_blocks_that_look_like_python() -> None:
    """A block that looks like Python but is fenced as plain text would escape the test above."""
    suspicious = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) == "" and re.search(r"^(import |from \S+ import )", m.group(2), re.MULTILINE):
                suspicious.append(f"{_page_id(page)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not suspicious, f"unlabelled code blocks that import things (label them python or text): {suspicious}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: pathlib.Path) -> None:
    missing = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{_page_id(page)} links to missing files: {missing}"
