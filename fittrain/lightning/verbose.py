"""The results table `Trainer.validate(verbose=True)` and `Trainer.test(verbose=True)` print, as Lightning's."""

from __future__ import annotations

import shutil


def print_results(title: str, results: dict[str, float]) -> None:
    """Prints `results` under "{title} metric" / "DataLoader 0" columns, sorted by name (Lightning's plain table)."""
    if not results:
        return
    width = max(shutil.get_terminal_size().columns, 40)
    half = (width - 1) // 2
    lines = ["─" * width, f"{title + ' metric':^{half}} {'DataLoader 0':^{half}}", "─" * width]
    lines += [f"{name:^{half}} {value!r:^{half}}" for name, value in sorted(results.items())]
    lines.append("─" * width)
    print("\n".join(lines))
