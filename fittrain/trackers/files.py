"""CSVTracker and JSONLTracker: dependency-free trackers that append to one file per run.

The CSV file is in long format, one row per value (`step,name,value,wall_time`), so a metric
that appears late (a validation metric, a second optimizer's learning rate) needs no new column
and the file never has to be rewritten while training. Either file loads in one line:
`pandas.read_csv(path).pivot_table(index="step", columns="name", values="value")`, or
`pandas.read_json(path, lines=True)`.
"""

from __future__ import annotations

import csv
import json
import os
import time
from typing import IO, Any, Iterable

from fittrain.trackers.base import GeneralTracker, RunInfo, as_number, check_values, flatten, hparams_of, unloggable

#: Seconds between flushes while logging, so a live reader sees recent values without a flush per step.
FLUSH_EVERY = 2.0
HPARAMS_FILE = "hparams.json"


class _FileTracker(GeneralTracker):
    """An append-only file `{logging_dir}/{run_name}/{FILE}`, flushed every few seconds."""

    FILE = ""
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, purge_step: int | None = None) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        os.makedirs(self.logging_dir, exist_ok=True)
        self.path = os.path.join(self.logging_dir, self.FILE)
        if purge_step is not None and os.path.exists(self.path):
            self._drop_from(purge_step)
        self._file: IO[str] | None = None
        self._open()
        self._next_step = 0
        self._flushed = time.monotonic()

    def _open(self) -> None:
        is_new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._start_file(is_new)

    @classmethod
    def for_run(cls, run: RunInfo, **kwargs: Any) -> "_FileTracker":
        return cls(run.name, run.logs_dir, purge_step=run.purge_step, **kwargs)

    @property
    def tracker(self) -> IO[str] | None:
        """The open file (None once finished)."""
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Writes the hyperparameters to `hparams.json` next to the file."""
        hparams = hparams_of(values, type(self).__name__)
        with open(os.path.join(self.logging_dir, HPARAMS_FILE), "w", encoding="utf-8") as f:
            json.dump(hparams, f, indent=2)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Appends `values` at `step` (None: the step after the last one logged)."""
        check_values(values, type(self).__name__)
        if kwargs:
            raise TypeError(f"`{type(self).__name__}.log` takes no extra arguments. Received: {sorted(kwargs)}.")
        entries = []
        for name, value in flatten(values):
            number = as_number(value)
            if number is None and not isinstance(value, str):
                raise unloggable(type(self).__name__, name, value)
            entries.append((name, value if number is None else number))
        self.log_scalars(dict(entries), self._next_step if step is None else int(step))

    def log_scalars(self, scalars: dict[str, Any], step: int) -> None:
        """The Logger's fast path: values already checked."""
        self._next_step = step + 1
        if self._file is None:
            return
        self._append(scalars, step, time.time())
        now = time.monotonic()
        if now - self._flushed > FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._flushed = time.monotonic()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def purge(self, step: int) -> None:
        """Drops the entries at `step` or later (a crashed run's, which the resumed run writes again)."""
        if self._file is not None:
            self._file.close()
            self._drop_from(step)
            self._open()

    def _drop_from(self, step: int) -> None:
        with open(self.path, newline="", encoding="utf-8") as f:
            kept = list(self._keep(f, step))
        temporary = self.path + ".purging"
        with open(temporary, "w", newline="", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, self.path)

    # What the formats define.
    def _start_file(self, is_new: bool) -> None:
        """Prepares to append to the open file; writes a header to a new one, if the format has one."""

    def _append(self, scalars: dict[str, Any], step: int, wall_time: float) -> None:
        raise NotImplementedError

    def _keep(self, lines: Iterable[str], step: int) -> Iterable[str]:
        raise NotImplementedError


class CSVTracker(_FileTracker):
    """Appends `step,name,value,wall_time` rows to `{logging_dir}/{run_name}/metrics.csv`.

    One row per value (long format), so new metric names never change the columns. Strings are
    written as they are; hyperparameters go to `hparams.json` beside it. A resumed run
    (`purge_step`) first drops the rows the interrupted run wrote from that step on.

    Args:
        run_name: The run's folder name under `logging_dir`.
        logging_dir: The folder holding the runs.
        purge_step: Drop existing rows at this step or later before appending.

    Example:
        >>> import csv
        >>> rows = list(csv.DictReader(open("runs/a/logs/run_1/metrics.csv")))
        >>> rows[0]
        {'step': '1', 'name': 'train_loss', 'value': '0.52', 'wall_time': '1764570605.1'}
    """

    name = "csv"
    FILE = "metrics.csv"
    COLUMNS = ("step", "name", "value", "wall_time")

    def _start_file(self, is_new: bool) -> None:
        self._rows = csv.writer(self._file)
        if is_new:
            self._rows.writerow(self.COLUMNS)

    def _append(self, scalars: dict[str, Any], step: int, wall_time: float) -> None:
        self._rows.writerows([(step, name, value, wall_time) for name, value in scalars.items()])

    def _keep(self, lines: Iterable[str], step: int) -> Iterable[str]:
        for i, line in enumerate(lines):
            # The header, and whole rows of earlier steps (the step is the first field, a plain
            # integer); a row cut short by a crash has no line end and is dropped.
            first = line.split(",", 1)[0]
            if i == 0 or (line.endswith("\n") and first.isdigit() and int(first) < step):
                yield line


class JSONLTracker(_FileTracker):
    """Appends one JSON line per `log` call to `{logging_dir}/{run_name}/metrics.jsonl`.

    Each line is `{"step": s, "wall_time": t, "values": {name: value, ...}}`. Hyperparameters go
    to `hparams.json` beside it. A resumed run (`purge_step`) first drops the lines the
    interrupted run wrote from that step on.

    Args:
        run_name: The run's folder name under `logging_dir`.
        logging_dir: The folder holding the runs.
        purge_step: Drop existing lines at this step or later before appending.
    """

    name = "jsonl"
    FILE = "metrics.jsonl"

    def _append(self, scalars: dict[str, Any], step: int, wall_time: float) -> None:
        self._file.write(json.dumps({"step": step, "wall_time": wall_time, "values": scalars}) + "\n")

    def _keep(self, lines: Iterable[str], step: int) -> Iterable[str]:
        for line in lines:
            if line.endswith("\n") and line.strip():  # a line cut short by a crash has no line end
                if json.loads(line)["step"] < step:
                    yield line
