"""`fittrain --version`, `python -m fittrain --version` and `fittrain.__version__`.

The version has one source, the installed package's metadata (setup.cfg's `version`), so each
check compares with `importlib.metadata.version("fittrain")`. The commands run for real, in
subprocesses, as a user types them.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest
import torch

import fittrain

pytestmark = pytest.mark.subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _run(command: list[str], cwd: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def _console_script() -> pathlib.Path:
    """The `fittrain` console script of the environment running the tests."""
    script = pathlib.Path(sysconfig.get_path("scripts")) / ("fittrain.exe" if os.name == "nt" else "fittrain")
    if not script.exists():
        pytest.skip(f"no `fittrain` console script at {script}: install fittrain (pip install -e .) first")
    return script


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_version_option_prints_fittrain_and_torch_versions(how: str, tmp_path: pathlib.Path) -> None:
    command = [str(_console_script())] if how == "console script" else [sys.executable, "-m", "fittrain"]
    done = _run([*command, "--version"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = f"fittrain {importlib.metadata.version('fittrain')} (torch {torch.__version__})"
    assert done.stdout.strip() == expected
    assert done.stderr == ""
    assert fittrain.__version__ == importlib.metadata.version("fittrain")  # the same single source


def test_version_falls_back_without_package_metadata(tmp_path: pathlib.Path) -> None:
    """Imported from a source tree that was never installed, `__version__` says it is unknown.

    The subprocess runs without `site` (-S), with a folder on its path that links to every entry of
    this environment's site-packages except fittrain's own (its metadata and its editable-install
    hook), and to this checkout's `fittrain/` source folder: torch imports, fittrain's metadata
    is nowhere.
    """
    site_packages = pathlib.Path(torch.__file__).resolve().parents[1]
    links = tmp_path / "path"
    links.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith(("fittrain", "__editable__")):
            (links / entry.name).symlink_to(entry)
    (links / "fittrain").symlink_to(REPO / "fittrain", target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(links))
    code = ("import importlib.metadata as m, fittrain\n"
            "try:\n    m.version('fittrain')\nexcept m.PackageNotFoundError:\n    print('no metadata')\n"
            "print(fittrain.__version__, fittrain.__file__)")
    done = _run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "no metadata"
    assert lines[1] == f"0+unknown {links / 'fittrain' / '__init__.py'}"
