"""The stream tests share their streams with the 2-process stream job: scripts/stream_data.py, which
they import as `stream_data`, as the job's workers do (its folder is first on their sys.path)."""

from __future__ import annotations

import sys

from support.jobs import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
