"""The installed fittrain's version, for `fittrain.__version__` and the command line."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """setup.cfg's version of the installed package; "0+unknown" for a source tree never installed."""
    try:
        return version("fittrain")
    except PackageNotFoundError:
        return "0+unknown"
