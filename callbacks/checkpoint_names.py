"""A Checkpointer's saves: their names (Lightning's `filename` templates and versions), their
ranking by a monitored metric, and the `last` link to the newest.

`NameTemplate` formats a template such as "{epoch}-{val_loss:.3f}" as Lightning's ModelCheckpoint
does: each field's name is inserted before its value ("epoch=3-val_loss=0.123",
`auto_insert_metric_name=True`), the format spec applies to the value, and a name may hold dots
("{val.loss}"). Where Lightning differs on purpose: a field whose value is missing is an error
naming the template, the field and the metrics that exist (Lightning puts 0 there), and a name
that would not be one folder name (a '/' in the template or in an inserted metric name, which
would make Lightning write into a subfolder) is refused when the Checkpointer is built.
`candidate_names` yields the name and its Lightning versions, "name-v1", "name-v2", ...; the
first free one names the save (`naming.reserve_named`), so no save ever replaces a folder.

`Ranking` orders the monitored saves (the top k plus the newest are kept) and travels in
checkpoints as JSON-safe pairs (`encode_ranking`); `LastLink` names `last` and points it at a save
once the save is committed (`run_folders.point_link`); `plan_save` works out one save's score,
name and link. The checks of `dirpath` and `save_last` are here too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import secrets
import string
from typing import Any, Iterator, Mapping

from fittrain.checkpoint import CheckpointError
from fittrain.checkpoint.run_folders import is_plain_name, point_link
from fittrain.common.reprs import short_repr
from fittrain.trainer.monitor import Monitor
from fittrain.trainer.parts import check_path

# A field as Lightning finds it: "{" then the name, up to the first ":" or "}".
_FIELD = re.compile(r"\{([^{}:!]*)")


class NameTemplate:
    """A checkpoint name template, checked when it is made and formatted at each save.

    Args:
        template: Such as "{epoch}-{step}", "{epoch}-{val_loss:.3f}" or "model-{epoch:02d}".
        auto_insert_metric_name: Write "name=" before each field's value, as Lightning does.
        equals: What joins an inserted name to its value (Lightning's CHECKPOINT_EQUALS_CHAR).
        argument: The argument that gave the template, for messages ("filename").

    Raises:
        TypeError: for a template that is not a str.
        ValueError: for an empty template, braces that do not pair, or a name that would not be
            one folder name (a separator or a leading '.', in the text or in an inserted metric name).
    """

    def __init__(self, template: Any, auto_insert_metric_name: bool = True, equals: str = "=",
                 argument: str = "filename") -> None:
        where = f"`Checkpointer({argument}=...)`"
        if not isinstance(template, str):
            raise TypeError(f"{where} must be a str such as '{{epoch}}-{{val_loss:.3f}}'. Received: "
                            f"{argument}={short_repr(template)} (type {type(template).__name__}).")
        self.template, self.argument = template, argument
        self.fields = sorted(set(_FIELD.findall(template)), key=len, reverse=True)
        converted = template
        for name in self.fields:  # longest first: "{epoch" must not eat "{epoch_loss"
            if auto_insert_metric_name:
                converted = converted.replace("{" + name, name + equals + "{" + name)
            converted = converted.replace("{" + name, "{0[" + name + "]")
        self._format = converted
        self._check(where, auto_insert_metric_name)

    def _check(self, where: str, inserted: bool) -> None:
        received = f"Received: {self.argument}={self.template!r}."
        try:
            list(string.Formatter().parse(self._format))
        except ValueError as err:
            raise ValueError(f"{where} is not a valid template ({err}). {received} Write each field as "
                             "{name} or {name:spec}, e.g. '{epoch}-{val_loss:.3f}'.") from None
        slashed = [name for name in self.fields if "/" in name or "\\" in name]
        if inserted and slashed:
            raise ValueError(
                f"{where} names the metric {slashed[0]!r}, and auto_insert_metric_name=True would write it into "
                f"the folder name, making a subfolder (as Lightning does). {received} Pass "
                "auto_insert_metric_name=False and write the text yourself, e.g. "
                f"'{{epoch}}-{slashed[0].replace('/', '_')}={{{slashed[0]}:.3f}}'.")
        text = re.sub(r"\{[^{}]*\}", "0", self._format)
        if not is_plain_name(text) or any(not name for name in self.fields):
            raise ValueError(f"{where} must make one folder name: no '/' or '\\', no leading '.', no empty "
                             f"field. {received} Write a name such as '{{epoch}}-{{step}}'.")

    def format(self, values: Mapping[str, Any], when: str = "") -> str:
        """The name for `values` (the epoch, the step and the metrics, by name).

        Args:
            values: Every field's value.
            when: Where the save happens, for messages (" at the save after optimizer step 4").

        Raises:
            ValueError: naming the template, the field and the values that exist, for a missing
                field or a value its format spec does not fit.
        """
        missing = [name for name in self.fields if name not in values]
        if missing:
            raise ValueError(
                f"`Checkpointer({self.argument}={self.template!r})` names {missing[0]!r}, which is neither "
                f"'epoch', 'step' nor a metric{when}. Metrics that exist: {sorted(values)}. Log it (self.log, "
                f"or return it from validation_step) before the first save, or leave it out of {self.argument}.")
        try:
            name = self._format.format(values)
        except (ValueError, TypeError, IndexError, KeyError) as err:
            shown = {field: values[field] for field in self.fields}
            raise ValueError(f"`Checkpointer({self.argument}={self.template!r})` cannot format {shown}{when}: "
                             f"{err}. Use a format spec that fits the value (metrics are floats, e.g. "
                             "'{val_loss:.3f}'; epoch and step are ints, e.g. '{epoch:02d}').") from None
        if not is_plain_name(name):
            raise ValueError(f"`Checkpointer({self.argument}={self.template!r})` made {name!r}{when}, which is not "
                             "one folder name (at most 200 bytes, no separator). Shorten the template.")
        return name


def candidate_names(base: str, join: str = "-", start: int = 1, extension: str = "") -> Iterator[str]:
    """`base + extension`, then Lightning's versions `base-v{start} + extension`, `base-v{start+1}`, ...

    Example:
        >>> list(itertools.islice(candidate_names("epoch=3"), 3))
        ['epoch=3', 'epoch=3-v1', 'epoch=3-v2']
    """
    yield base + extension
    version = start
    while True:
        yield f"{base}{join}v{version}{extension}"
        version += 1


class Ranking:
    """The monitored checkpoints not yet deleted, in save order, with their scores.

    The best is first by the monitor's mode (`Monitor.rank_key`: NaN and infinite scores rank
    below every finite one), and a tie goes to the earlier save. The top k plus the newest are kept.
    """

    def __init__(self, monitor: Monitor | None, top_k: int | None) -> None:
        self._monitor = monitor
        self._top_k = top_k
        self.entries: list[tuple[float, str]] = []

    def _ordered(self) -> list[int]:
        rank = self._monitor.rank_key
        return sorted(range(len(self.entries)), key=lambda i: (*rank(self.entries[i][0]), i))

    def best(self) -> tuple[float, str]:
        """The best entry's (score, name); call only when there are entries."""
        return self.entries[self._ordered()[0]]

    def top(self) -> list[tuple[float, str]]:
        """The best k entries (every entry without a top k), best first."""
        return [self.entries[i] for i in self._ordered()[:self._top_k]]

    def beaten(self) -> list[str]:
        """The names neither among the top k nor the newest; none without a top k."""
        if self._top_k is None:
            return []
        keep = set(self._ordered()[:self._top_k]) | {len(self.entries) - 1}
        return [name for i, (_, name) in enumerate(self.entries) if i not in keep]

    def forget(self, names: list[str]) -> None:
        gone = set(names)
        self.entries = [entry for entry in self.entries if entry[1] not in gone]


_NOT_FINITE = ("nan", "inf", "-inf")


def encode_ranking(entries: list[tuple[float, str]]) -> list[list[Any]]:
    """JSON-safe [score, name] pairs: a NaN or infinite score is written as 'nan', 'inf' or '-inf'."""
    return [[score if math.isfinite(score) else repr(score), name] for score, name in entries]


def decode_ranking(raw: Any) -> list[tuple[float, str]]:
    """Reads what `encode_ranking` wrote, refusing anything else (a name that is not one plain folder
    name above all, since the names are deleted)."""
    entries = []
    for item in raw if isinstance(raw, list) else [raw]:
        pair = isinstance(item, (list, tuple)) and len(item) == 2
        score, name = item if pair else (None, None)
        number = isinstance(score, (int, float)) and not isinstance(score, bool)
        spelled = isinstance(score, str) and score in _NOT_FINITE
        if not (is_plain_name(name) and (number or spelled)):
            raise CheckpointError(
                f"The Checkpointer's state in this checkpoint holds a damaged ranking entry: {item!r:.120}. "
                "Each must be [score, '<folder name>']. Resume from another checkpoint, or without monitor=....")
        entries.append((float(score), name))
    return entries


class LastLink:
    """A Checkpointer's `last`: which name it has, and pointing it at a save once that save is committed.

    The name is the first of Lightning's versions of the formatted `CHECKPOINT_NAME_LAST` that is
    free or is this link already, so another run's `last` in a shared folder is never taken over.
    Only the main process touches the folder.

    Args:
        folder: The folder the link lives in, beside the saves.
        join, start, extension: The Checkpointer's CHECKPOINT_JOIN_CHAR, STARTING_VERSION, FILE_EXTENSION.
    """

    def __init__(self, folder: pathlib.Path, join: str, start: int, extension: str) -> None:
        self.folder, self._versions = folder, (join, start, extension)
        self.name: str | None = None  # planned at the newest save (every process)
        self._made: str | None = None  # the link on disk (main process)
        self._pending: tuple[str, str] | None = None

    def choose(self, base: str) -> str:
        """The link's name for a save whose formatted `CHECKPOINT_NAME_LAST` is `base` (main process)."""
        for name in candidate_names(base, *self._versions):
            if name == self.name or not os.path.lexists(self.folder / name):
                return name
        raise AssertionError("unreachable: candidate_names never ends")

    def plan(self, name: str, target: str) -> None:
        """Notes that `name` will lead to the save `target` once it is committed (every process)."""
        self.name, self._pending = name, (name, target)

    def restore(self, name: str) -> None:
        """Takes over `name`, a link a resumed checkpoint recorded, if it is in the folder."""
        if os.path.lexists(self.folder / name):
            self.name = self._made = name

    def settle(self, is_main_process: bool) -> bool:
        """Points the link at the save planned (now committed); a link a template moved on from goes.

        Returns:
            Whether a save was planned (on every process).
        """
        if self._pending is None:
            return False
        (name, target), self._pending = self._pending, None
        if not is_main_process or name == target:  # a save named like the link is its own `last`
            return True
        point_link(self.folder, name, target)
        old = self.folder / self._made if self._made not in (None, name) else None
        if old is not None and old.is_symlink():
            old.unlink()
        self._made = name
        return True


@dataclasses.dataclass
class SavePlan:
    """What one save is, the same on every process: its score, its name (None: numbered), its `last`
    link's name, or the error that refuses it."""

    score: float | None = None
    name: str | None = None
    link: str | None = None
    error: str | None = None


#: How a missing monitored metric is refused: (the argument that names it, a further fix).
MONITOR_REFUSAL = ("`Checkpointer(monitor=...)`", "; and save after validations: every_n_epochs=..., or "
                   "every_n_steps=... a multiple of Trainer(val_every_n_steps=...)")


def plan_save(state: Any, monitor: Monitor | None, lenient: bool, names: NameTemplate | None,
              last: NameTemplate | None, link: LastLink, step: int | None = None,
              refusal: tuple[str, str] = MONITOR_REFUSAL) -> SavePlan:
    """Works out a save from the Trainer's `state` (on the main process); an error is returned, not raised,
    so that the caller can share it and every process raises alike.

    Args:
        state: The TrainState: its metrics, epoch and optimizer step fill the templates.
        monitor: What ranks the save, or None.
        lenient: A missing monitored metric ranks the save last (NaN) instead of refusing it.
        names, last: The filename's and the `last` link's templates, or None.
        link: The `last` link, which chooses its name.
        step: What `{step}` is: the Trainer's own count when it keeps one (fittrain.lightning counts every
            optimizer.step(), as Lightning does); by default the optimizer steps of `state`.
        refusal: For a missing monitored metric: the argument that names it and a further fix, in the
            terms of the callback's class (`MONITOR_REFUSAL`, or fittrain.lightning's ModelCheckpoint's).
    """
    step = state.global_step if step is None else step
    metrics, when = state.metrics, f" at the save after optimizer step {step}"
    values = {**metrics, "epoch": state.epoch, "step": step}
    plan = SavePlan()
    try:
        if monitor is not None:
            plan.score = _score(monitor, metrics, when, lenient, refusal)
        if names is not None:
            plan.name = names.format(values, when)
        if last is not None:
            plan.link = link.choose(last.format(values, when))
    except ValueError as err:
        plan.error = str(err)
    return plan


def _score(monitor: Monitor, metrics: dict[str, float], when: str, lenient: bool, refusal: tuple[str, str]) -> float:
    value = monitor.read(metrics)
    if value is not None:
        return float(value)
    if lenient:  # it was there before (a run that popped it), or the save at train end: rank it last
        return math.nan
    where, then = refusal
    raise ValueError(monitor.missing(sorted(metrics), where, when, then))


def check_save_last(value: Any) -> bool | str:
    """`Checkpointer(save_last=...)`: True, False or Lightning's "link"."""
    if value is True or value is False or value == "link":
        return value
    raise ValueError(f"`Checkpointer(save_last=...)` must be True, False or 'link'. Received: "
                     f"save_last={short_repr(value)}. Pass True to keep a `last` link to the newest checkpoint.")


def check_dirpath(dirpath: Any) -> str | None:
    """`Checkpointer(dirpath=...)` as an absolute path (resolved against the working directory, as Lightning does)."""
    check_path("dirpath", dirpath, optional=True)
    if dirpath is None:
        return None
    if not os.fspath(dirpath):
        raise ValueError("`Checkpointer(dirpath=...)` must name a folder. Received: dirpath=''. Pass e.g. "
                         "dirpath='checkpoints/best', or None for the run's folder.")
    return os.path.abspath(os.path.expanduser(os.fspath(dirpath)))


def check_writable(folder: pathlib.Path, given: str) -> None:
    """Creates `folder` and a probe file in it, so an unwritable folder fails now, not at the first save.

    Raises:
        OSError: of the same kind and errno as the failure, naming the folder and the fix (`given`).
    """
    probe = folder / f".write-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        raise OSError(err.errno, f"Checkpointer cannot write checkpoints to {str(folder)!r}: {err.strerror or err}. "
                                 f"Pass {given}, or make that folder writable.") from err
