"""The parameter table a fit prints at its start (`Trainer(enable_model_summary=True)`, the default).

`summarize(module, max_depth)` lays it out as Lightning's `ModelSummary` does, so a Lightning user
reads the same table: one row per submodule (name, type, parameters, train/eval mode), parameters
not in any listed submodule as "other params", then the trainable, non-trainable and total counts,
the parameters' size in MB and the modules in train and eval mode. Two differences: there is no
FLOPs column (Lightning's reads 0 unless the module has an `example_input_array` to run), and the
size is the parameters' own bytes (Lightning assumes 32 bits unless the precision is "16-true" or
the like; the same for float32 parameters). `fittrain.lightning.callbacks.ModelSummary(max_depth)`
reuses `summarize`.

The Trainer's progress display (fittrain/trainer/progress.py, also a Logger's) prints the table on
the main process in `on_fit_start`, as Lightning's ModelSummary callback does, before `prepare()`
shards anything, so the counts are the whole model's. A fit without a display prints none.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.nn.parameter import UninitializedParameter

from fittrain.common.checks import ArgumentTypeError, is_int
from fittrain.common.reprs import short_repr

_UNITS = (" ", "K", "M", "B", "T")


def human_count(number: float) -> str:
    """`number` in Lightning's short form: "123  ", "1.2 K", "50.4 K", "400 T"."""
    digits = int(math.floor(math.log10(number)) + 1) if number > 0 else 1
    groups = min(-(-digits // 3), len(_UNITS))
    scaled = number / 10 ** (3 * (groups - 1))
    if groups == 1 or scaled >= 100:
        return f"{int(scaled):,d} {_UNITS[groups - 1]}"
    return f"{scaled:,.1f} {_UNITS[groups - 1]}"


def _count(module: nn.Module, trainable_only: bool = False) -> int:
    # A lazy module's parameters have no size yet: counted as 0, as Lightning does.
    return sum(p.numel() for p in module.parameters()
               if not isinstance(p, UninitializedParameter) and (p.requires_grad or not trainable_only))


def _rows(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    """The listed submodules: children for depth 1, every descendant up to `max_depth` levels (-1: all)."""
    if max_depth == 0:
        return []
    return [(name, sub) for name, sub in list(module.named_modules())[1:]
            if max_depth == -1 or name.count(".") < max_depth]


def _table(columns: list[tuple[str, list[str]]]) -> list[str]:
    widths = [max([len(header), *(len(cell) for cell in cells)]) for header, cells in columns]
    rule = "-" * (sum(widths) + 3 * (len(columns) + 1))
    lines = [" | ".join(f"{header:<{w}}" for (header, _), w in zip(columns, widths)), rule]
    for row in zip(*(cells for _, cells in columns)):
        lines.append(" | ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)))
    return [*lines, rule]


def summarize(module: nn.Module, max_depth: int = 1) -> str:
    """The parameter table of `module`, laid out as Lightning's `ModelSummary` (see the module docstring).

    Args:
        module: The model (a TrainModule, or any nn.Module).
        max_depth: How deep submodules are listed: 1 its children (the default), n up to n levels,
            -1 all of them, 0 none (the totals only).

    Raises:
        ValueError: for a `max_depth` that is not an int >= -1.

    Example:
        >>> print(summarize(module))
          | Name | Type   | Params | Mode
        ---------------------------------------
        0 | net  | Linear | 4      | train
        ...
    """
    if not is_int(max_depth) or max_depth < -1:
        error = ValueError if is_int(max_depth) else ArgumentTypeError
        raise error(f"`max_depth` must be an int >= -1 (-1: every submodule, 0: none, n: n levels). Received: "
                    f"max_depth={short_repr(max_depth)}.")
    rows = _rows(module, max_depth)
    counts = [_count(sub) for _, sub in rows]
    columns: list[tuple[str, list[Any]]] = [
        (" ", [str(i) for i in range(len(rows))]), ("Name", [name for name, _ in rows]),
        ("Type", [type(sub).__name__ for _, sub in rows]), ("Params", [human_count(n) for n in counts]),
        ("Mode", ["train" if sub.training else "eval" for _, sub in rows])]
    total, trainable = _count(module), _count(module, trainable_only=True)
    if total - sum(counts) > 0:  # parameters of the module itself, outside every listed submodule
        for (_, cells), extra in zip(columns, (" ", "other params", "n/a", human_count(total - sum(counts)), "n/a")):
            cells.append(extra)
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()
                  if not isinstance(p, UninitializedParameter)) / 1e6
    modes = [sub.training for sub in list(module.modules())[1:]]
    totals = [(human_count(trainable), "Trainable params"), (human_count(total - trainable), "Non-trainable params"),
              (human_count(total), "Total params"), (f"{size_mb:,.3f}", "Total estimated model params size (MB)"),
              (str(modes.count(True)), "Modules in train mode"), (str(modes.count(False)), "Modules in eval mode")]
    return "\n".join(_table(columns) + [f"{value:<10}{label}" for value, label in totals])
