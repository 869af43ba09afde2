"""`Monitor`: one watched metric, whether lower or higher is better, and the best value so far.

EarlyStop, the Checkpointer's ranking (`monitor=`) and the plateau scheduler (`MetricSchedule`)
each own one, so the name and mode checks, reading the value, "is this better than the best" and
the message for a missing metric are written once (Keras's `MonitorCallback`, as an object a
callback or a schedule holds rather than a base class, since the scheduler is no callback).

"max" is handled as "min" of the negated value, so every comparison is written once.

Example:
    >>> monitor = Monitor("val_acc", "max", owner="EarlyStop")
    >>> monitor.update(0.8), monitor.update(0.7), monitor.best
    (True, False, 0.8)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fittrain.common.checks import check_choice
from fittrain.common.reprs import short_repr
from fittrain.trainer.parts import LazyMetrics

_MODES = ("min", "max")


def _refuse(owner: str, name: str, value: Any, wanted: str) -> ValueError:
    return ValueError(f"`{owner}({name}=...)` must be {wanted}. Received: {name}={short_repr(value)}.")


class Monitor:
    """A metric to watch: its name, its mode, the smallest change that counts, the best value so far.

    Args:
        name: The metric, such as "val_loss" or a name `validation_step` returns.
        mode: "min" if lower is better, "max" if higher is better.
        min_delta: The smallest change that counts as an improvement (0 or more).
        owner: Whose arguments these are, for messages ("EarlyStop", "Checkpointer").
        wanted: How the owner's message describes a valid `name`.

    Raises:
        ValueError: for a name that is not a non-empty str, another mode, or a negative or NaN `min_delta`.
    """

    def __init__(self, name: Any, mode: Any = "min", min_delta: Any = 0.0, *, owner: str,
                 wanted: str = "a metric name") -> None:
        if not (isinstance(name, str) and name):
            raise _refuse(owner, "monitor", name, wanted)
        check_choice("mode", mode, _MODES, owner=owner)
        number = isinstance(min_delta, (int, float)) and not isinstance(min_delta, bool)
        if not (number and min_delta >= 0):  # NaN fails the comparison too
            raise _refuse(owner, "min_delta", min_delta, "a number of at least 0")
        self.name, self.mode, self.min_delta = name, mode, float(min_delta)
        self.best: float | None = None
        self._sign = 1.0 if mode == "min" else -1.0

    def reset(self) -> None:
        """Forgets the best value (at the start of a fit)."""
        self.best = None

    def read(self, metrics: Mapping[str, Any]) -> float | None:
        """The watched value among `metrics` as a float (a tensor costs one device sync), or None."""
        value = metrics.get(self.name)
        if value is None or isinstance(value, float):
            return value
        return LazyMetrics({self.name: value}).as_floats()[self.name]

    def improves(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than `min_delta`; any non-NaN value beats none."""
        if self.best is None:
            return not math.isnan(value)
        return self._sign * value < self._sign * self.best - self.min_delta

    def update(self, value: float) -> bool:
        """Makes `value` the best when it `improves`; returns whether it did."""
        better = self.improves(value)
        if better:
            self.best = value
        return better

    def rank_key(self, value: float) -> tuple[bool, float]:
        """Sorts values best first: by the mode, with NaN and infinite values after every finite one."""
        finite = math.isfinite(value)
        return (not finite, self._sign * value if finite else 0.0)

    def missing(self, metrics: Any, where: str, when: str = "", then: str = "") -> str:
        """The message for a watched metric that is not among `metrics` (their names are listed).

        Args:
            metrics: The metrics that exist (a mapping or their names).
            where: The argument that names the metric, e.g. "`EarlyStop(monitor=...)`".
            when: Where it was looked for, appended to "does not exist".
            then: A further fix, appended to the message's last sentence.
        """
        return (f"{where} names a metric that does not exist{when}. Received: monitor={self.name!r}. Metrics that "
                f"exist: {sorted(metrics)}. Pass one of them, or return/log {self.name!r} from validation_step{then}.")

    def __repr__(self) -> str:
        return f"Monitor({self.name!r}, mode={self.mode!r}, min_delta={self.min_delta}, best={self.best})"
