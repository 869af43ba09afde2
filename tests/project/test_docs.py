"""Every ```python block in README.md and docs/*.md runs as it stands.

The blocks of one Markdown file run in order, in one namespace, so a page may build on its
earlier blocks as a reader following it would. Each file starts from a fresh namespace in its own
empty working folder, with the global RNG seeded and restored afterwards. Blocks that are not
meant to run (fragments, shell commands, output) are marked ```text, ```bash and so on.

Relative links in the same files must point at files that exist.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from support.doc_pages import FENCE, PAGES, RUNNABLE, page_id, run_page

LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_blocks_run(page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_page(page, tmp_path, monkeypatch)


def test_no_unlabelled_code_blocks_that_look_like_python() -> None:
    """A block that looks like Python but is fenced as plain text would escape the test above."""
    suspicious = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(1) == "" and re.search(r"^(import |from \S+ import )", m.group(2), re.MULTILINE):
                suspicious.append(f"{page_id(page)}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not suspicious, f"unlabelled code blocks that import things (label them python or text): {suspicious}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: pathlib.Path) -> None:
    missing = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{page_id(page)} links to missing files: {missing}"
