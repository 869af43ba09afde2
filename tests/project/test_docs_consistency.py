"""One source per fact: the docs show what the code defines, and a test notices when they drift.

- The event order lives in `fittrain/trainer/events.py`: the `Event` enum names the events, and the
  module docstring's first literal block (the one after "::") is the loop `Trainer.fit` runs. Every
  page that draws that loop (a ```text block from `on_fit_start` to `on_fit_end`) must draw the same
  skeleton: the same events, under the same `for`/`if` nesting. The wording around them is free.
- The module map lives in the package docstrings: each subpackage's `__init__` docstring names every
  module it holds, and docs/design.md keeps no hand-written list of modules.
- The layer picture in docs/design.md lists the layers of the import-linter contract in
  pyproject.toml, in the same order.
"""

from __future__ import annotations

import ast
import configparser
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
EVENT = re.compile(r"\bon_[a-z_]+\b")
# A skeleton line: (nesting depth, what it is), e.g. (2, "on_train_batch_start") or (1, "for").
Skeleton = list[tuple[int, str]]
EVENTS_PY = ROOT / "fittrain" / "trainer" / "events.py"


def _events_docstring() -> str:
    # Read from the source, not imported: the docs checks stay independent of the package importing.
    return ast.get_docstring(ast.parse(EVENTS_PY.read_text(encoding="utf-8"))) or ""


def _event_names() -> set[str]:
    from fittrain.trainer.events import Event  # imported per test, so collecting this file needs no torch

    return {e.value for e in Event}


def _literal_blocks(docstring: str) -> list[str]:
    """The reStructuredText literal blocks of a docstring: the indented lines after a line ending in "::"."""
    blocks, lines = [], docstring.splitlines()
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        body = []
        for following in lines[i + 1:]:
            if following.strip() and not following.startswith((" ", "\t")):
                break
            body.append(following)
        blocks.append("\n".join(body).strip("\n"))
    return blocks


def skeleton(loop: str) -> Skeleton:
    """The events of a drawn loop and the `for`/`if` lines that nest them, with their depth.

    A line that starts with an event contributes every event named before its comment (two or more
    spaces, or "#"), so `on_validation_start ... on_validation_end   # mid-epoch` gives both. Lines in
    [brackets] or (parentheses) are notes about work without events, and continuation lines of a
    comment start with neither an event nor `for`/`if`: both are skipped.
    """
    lines = [line for line in loop.splitlines() if line.strip()]
    base = min(len(line) - len(line.lstrip()) for line in lines)
    result: Skeleton = []
    open_note = 0  # brackets still open of a note that started a line (notes may span lines)
    for line in lines:
        text, depth = line.strip(), (len(line) - len(line.lstrip()) - base) // 4
        if open_note or text.startswith(("(", "[")):
            open_note += text.count("(") + text.count("[") - text.count(")") - text.count("]")
            open_note = max(open_note, 0)
        elif text.startswith("on_"):
            code = re.split(r"\s{2,}|#", text)[0]
            result.extend((depth, name) for name in EVENT.findall(code))
        elif text.startswith(("for ", "if ")):
            result.append((depth, text.split()[0]))
    return result


def _fit_loop_in_events_py() -> str:
    blocks = _literal_blocks(_events_docstring())
    assert blocks and "on_fit_start" in blocks[0], (
        "fittrain/trainer/events.py's docstring must start its first literal block (after a line ending "
        "in '::') with the loop Trainer.fit runs, from on_fit_start to on_exception: the docs are checked "
        "against it.")
    return blocks[0]


def _drawn_fit_loops() -> list[tuple[str, str]]:
    """(where, block) of every ```text block in README.md and docs/ that draws the fit loop."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            block = m.group(2)
            if m.group(1) == "text" and re.search(r"^\s*for each epoch", block, re.M) and "on_fit_end" in block:
                line = text.count("\n", 0, m.start()) + 1
                found.append((f"{page.relative_to(ROOT).as_posix()}:{line}", block))
    return found


def test_the_events_docstring_names_every_event_and_nothing_else() -> None:
    named = {name for block in _literal_blocks(_events_docstring()) for name in EVENT.findall(block)}
    enum = _event_names()
    assert named == enum, (f"events.py's docstring and its Event enum disagree. Only in the docstring: "
                           f"{sorted(named - enum)}; only in the enum: {sorted(enum - named)}.")


def test_design_md_draws_the_fit_loop() -> None:
    assert any(where.startswith("docs/design.md:") for where, _ in _drawn_fit_loops()), (
        "docs/design.md must show the event order as a ```text block from on_fit_start to on_fit_end.")


@pytest.mark.parametrize("where, block", [pytest.param(*loop, id=loop[0]) for loop in _drawn_fit_loops()])
def test_every_drawn_fit_loop_has_the_order_of_events_py(where: str, block: str) -> None:
    expected, drawn = skeleton(_fit_loop_in_events_py()), skeleton(block)
    assert drawn == expected, (
        f"The loop drawn at {where} differs from fittrain/trainer/events.py's docstring, the one source of "
        f"the event order.\n  events.py: {expected}\n  {where}: {drawn}\nRedraw it from events.py.")


def test_the_hooks_table_lists_every_event_once() -> None:
    text = (ROOT / "docs" / "custom_callbacks.md").read_text(encoding="utf-8")
    hooks_section = text.split("\n## Hooks\n", 1)[1].split("\n## ", 1)[0]  # the module hooks' table comes later
    rows = [line for line in hooks_section.splitlines() if line.startswith("| `on_")]
    listed = [name for row in rows for name in EVENT.findall(row.split("|")[1])]
    assert sorted(listed) == sorted(_event_names()), (
        f"docs/custom_callbacks.md's hooks table must list each Event once. Received: {listed}")


def _subpackages() -> list[pathlib.Path]:
    """Every package under fittrain/, and callbacks/ (installed as fittrain.callbacks)."""
    packages = [p.parent for p in (ROOT / "fittrain").glob("**/__init__.py") if p.parent != ROOT / "fittrain"]
    return sorted([*packages, ROOT / "callbacks"])


@pytest.mark.parametrize("package", _subpackages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_package_docstring_names_all_its_modules(package: pathlib.Path) -> None:
    """The package docstrings are the module map: a module missing from its package's docstring is
    a module a newcomer cannot find from the tree and the docstrings alone."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    members = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    members += [p.parent.name for p in package.glob("*/__init__.py")]
    missing = [name for name in sorted(members) if not re.search(rf"\b{name}\b", docstring)]
    assert not missing, (f"{package.relative_to(ROOT).as_posix()}/__init__.py's docstring, the module map, "
                         f"does not name {missing}. Add a line for each.")


def test_design_md_keeps_no_hand_written_module_list() -> None:
    """Lines that start with a module file name, like those of the old module map, belong in the
    package docstrings; design.md points at them instead."""
    text = DESIGN.read_text(encoding="utf-8")
    listed = [line.strip() for m in FENCE.finditer(text) for line in m.group(2).splitlines()
              if re.match(r"\s*(fittrain/)?[\w/]*\w+\.py\b", line)]
    assert not listed, f"docs/design.md lists modules by hand (keep them in the package docstrings): {listed}"


def test_design_md_draws_the_layers_of_the_import_contract() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    lines = [line.strip() for line in DESIGN.read_text(encoding="utf-8").splitlines()]
    positions = []
    for layer in contract["layers"]:
        hits = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(layer)}(\s{{2,}}|$)", line)]
        assert hits, f"docs/design.md's layer picture has no line that starts with the layer {layer!r}"
        positions.append(hits[0])
    assert positions == sorted(positions), (
        f"docs/design.md draws the layers in another order than pyproject.toml's contract: {contract['layers']}")


def test_setup_cfg_ships_every_package() -> None:
    """setup.cfg lists its packages by hand: a subpackage missing there is left out of a regular install
    (an editable one still finds it, so nothing else would notice)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    listed = set(config["options"]["packages"].split())
    found = {"fittrain.callbacks" if p == ROOT / "callbacks" else ".".join(p.relative_to(ROOT).parts)
             for p in [ROOT / "fittrain", *_subpackages()]}
    assert listed == found, (f"setup.cfg's packages differ from the package folders: missing "
                             f"{sorted(found - listed)}, extra {sorted(listed - found)}")
