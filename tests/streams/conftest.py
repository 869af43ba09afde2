"""The stream tests share their streams with the 2-process stream job (tests/support/scripts)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "support" / "scripts"))
