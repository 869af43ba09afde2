"""The design's packaging installs both as a regular install and as an editable one.

Each test builds a throwaway virtual environment and installs a copy of this source tree into it
with `pip install --no-deps --no-build-isolation`, then imports fittrain from a folder outside
the tree. Nothing is downloaded: the new environment sees the packages of the environment
running the tests (torch, numpy, pip, setuptools, ...) through a `.pth` file that lists their
folder.

Why not `venv --system-site-packages`: the tests usually run inside a virtual environment
themselves (the README's command and `.ci/run` create one), and "system" site-packages then
means the base interpreter's, which has no torch. The `.pth` path line also keeps the parent's
own editable fittrain out of sight: Python adds a path line to sys.path but does not run the
`.pth` files found in that folder, and the parent's editable install is such a `.pth` file. Each
test first proves that `import fittrain` fails in the fresh environment, so every later import
that succeeds comes from the environment's own install.

The source is copied to a temporary folder first, so a build never writes into the working tree
and the editable install is visibly bound to the copy, not to the parent's checkout.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

CHECK = """
import json, pathlib, sys
import fittrain, fittrain.callbacks
from fittrain.callbacks import *
from fittrain import Accelerator, Callback, ProjectConfiguration, Trainer, TrainModule, TrainState
import importlib, torch
for extra in sys.argv[1:]:  # modules the test added to the source after installing
    importlib.import_module(extra)
model = Accelerator(cpu=True).prepare(torch.nn.Linear(2, 1))
assert model(torch.ones(1, 2)).shape == (1, 1)
package = pathlib.Path(fittrain.__file__).resolve().parent
print(json.dumps({
    "fittrain": str(pathlib.Path(fittrain.__file__).resolve()),
    "callbacks": str(pathlib.Path(fittrain.callbacks.__file__).resolve()),
    "typed": (package / "py.typed").is_file(),
    # Everything fittrain.callbacks exports arrived through the star import.
    "star_missing": [n for n in getattr(fittrain.callbacks, "__all__", []) if n not in globals()],
}))
"""


def _build_backend_problem() -> str | None:
    """Why the parent environment cannot build fittrain without isolation, or None if it can.

    setuptools builds wheels by itself from 70.1 on; older versions need the `wheel` package.
    """
    try:
        setuptools_version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed in the test environment"
    numbers = re.match(r"(\d+)(?:\.(\d+))?", setuptools_version)
    if numbers and (int(numbers[1]), int(numbers[2] or 0)) >= (70, 1):
        return None
    try:
        importlib.metadata.version("wheel")
    except importlib.metadata.PackageNotFoundError:
        return (f"setuptools {setuptools_version} needs the `wheel` package to build, and it is not "
                "installed; install setuptools>=70.1 (e.g. through the dev extra) to run this test")
    return None


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PIP_CONFIG_FILE=os.devnull)
    return env


def _run(args: list[str], cwd: pathlib.Path, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=180)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


def _copy_source(dst: pathlib.Path) -> pathlib.Path:
    """Copies the files git would ship (tracked, plus new files that are not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            source = REPO / name
            if source.is_file():
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dst / name)
    else:  # not a git checkout (e.g. an unpacked sdist): copy all but build leftovers
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*venv*"))
    return dst


def _make_venv(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A bare virtual environment that sees the parent's packages through a `.pth` path line.

    Returns:
        Its python executable and its site-packages folder.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    if not site.is_dir():  # a distribution-patched default scheme: ask the environment itself
        site = pathlib.Path(_run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 cwd=path).stdout.strip())
    parent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_parent_environment.pth").write_text("".join(f"{p}\n" for p in parent))
    return python, site


@pytest.fixture
def outside(tmp_path: pathlib.Path) -> pathlib.Path:
    """A working folder outside the source tree, so `import fittrain` cannot come from the cwd."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


@pytest.fixture
def fresh_venv(tmp_path: pathlib.Path, outside: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    problem = _build_backend_problem()
    if problem:
        pytest.skip(problem)
    python, site = _make_venv(tmp_path / "venv")
    probe = ("import importlib.util, setuptools, sys; print(setuptools.__file__); "
             "print(importlib.util.find_spec('fittrain'))")
    backend, visible = _run([python, "-I", "-c", probe], cwd=outside).stdout.strip().splitlines()
    # The build backend is the parent's setuptools, seen through the .pth file.
    assert pathlib.Path(backend).is_relative_to(sysconfig.get_paths()["purelib"]), backend
    # The control: no fittrain is visible before the install, not even the parent's editable one.
    assert visible == "None"
    return python, site


def _install(python: pathlib.Path, cwd: pathlib.Path, *target: str) -> None:
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", *target], cwd=cwd)


def _check(python: pathlib.Path, cwd: pathlib.Path, *extra_modules: str) -> dict:
    return json.loads(_run([python, "-I", "-c", CHECK, *extra_modules], cwd=cwd).stdout.strip().splitlines()[-1])


def _packages(folder: pathlib.Path, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The subpackages under `folder` (folders with an __init__.py), as name paths below it."""
    return {prefix + init.parent.relative_to(folder).parts for init in folder.rglob("__init__.py")
            if init.parent != folder and "__pycache__" not in init.parts}


def _parent_fittrain_entries() -> list[str]:
    """The parent environment's own fittrain install (dist-info, editable hooks), if any.

    pip in the throwaway environment sees that install through the `.pth` path line; it must
    leave it alone (pip never uninstalls outside the environment it runs in).
    """
    return sorted(str(p) for p in pathlib.Path(sysconfig.get_paths()["purelib"]).glob("*fittrain*"))


def test_regular_install_ships_fittrain_callbacks_and_py_typed(tmp_path, fresh_venv, outside):
    python, site = fresh_venv
    source = _copy_source(tmp_path / "src")
    parent_entries = _parent_fittrain_entries()
    packages = _packages(source / "fittrain") | {("callbacks",)} | _packages(source / "callbacks", ("callbacks",))
    _install(python, outside, str(source))
    assert _parent_fittrain_entries() == parent_entries
    shutil.rmtree(source)  # a regular install is a copy: it must not need the source any more
    # Every subpackage of the source ships (setup.cfg lists them one by one: a new one must be added there).
    assert _packages(site / "fittrain") == packages

    found = _check(python, outside)
    site = site.resolve()
    assert pathlib.Path(found["fittrain"]) == site / "fittrain" / "__init__.py"
    assert pathlib.Path(found["callbacks"]) == site / "fittrain" / "callbacks" / "__init__.py"
    assert found["typed"] is True
    assert found["star_missing"] == []


def test_editable_install_maps_fittrain_and_callbacks_to_the_source(tmp_path, fresh_venv, outside):
    python, _ = fresh_venv
    source = _copy_source(tmp_path / "src").resolve()
    parent_entries = _parent_fittrain_entries()
    _install(python, outside, "-e", str(source))
    assert _parent_fittrain_entries() == parent_entries

    # Editable means live: a module added to the top-level callbacks/ folder after the install
    # is importable as part of fittrain.callbacks.
    (source / "callbacks" / "_added_after_install.py").write_text("VALUE = 42\n")
    found = _check(python, outside, "fittrain.callbacks._added_after_install")
    assert pathlib.Path(found["fittrain"]) == source / "fittrain" / "__init__.py"
    assert pathlib.Path(found["callbacks"]) == source / "callbacks" / "__init__.py"
    assert found["typed"] is True
    assert found["star_missing"] == []
