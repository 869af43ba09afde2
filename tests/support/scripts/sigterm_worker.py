"""A plain worker (no fittrain) that survives SIGTERM and records each one it receives.

Writes `<out>/ready.rank<R>` once its handler is in place, and appends a line to
`<out>/term.rank<R>` for every SIGTERM; it exits on its own after 120 s at the latest.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

LIFETIME = 120.0


def main() -> None:
    out, rank = pathlib.Path(sys.argv[1]), os.environ["RANK"]

    def record(signum: int, frame: object) -> None:
        with open(out / f"term.rank{rank}", "a", encoding="utf-8") as handle:
            handle.write(f"SIGTERM at {time.time()}\n")

    signal.signal(signal.SIGTERM, record)
    (out / f"ready.rank{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + LIFETIME
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
