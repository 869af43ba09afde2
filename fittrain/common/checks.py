"""Argument checks shared by every layer, so that a bad value is refused in the same words everywhere.

Each check returns the value it accepted and raises an error that names the argument, quotes the
value received (`short_repr`) and, when the caller gives one, says what to pass instead:

    >>> check_positive_int("every_n_steps", 0, owner="Checkpointer", optional=True)
    ValueError: `Checkpointer(every_n_steps=...)` must be a positive integer or None. Received: every_n_steps=0.

A value of the wrong type raises `ArgumentTypeError`, which is both a TypeError and a ValueError:
fittrain refused wrong types with either, and callers (and their tests) catch both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from fittrain.common.reprs import short_repr


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a bool or str where a count belongs, a "yes" where a bool does).

    Both a TypeError, as Python's convention has it, and a ValueError, as fittrain's count checks
    have always raised: `except TypeError` and `except ValueError` both catch it.
    """


def _label(name: str, owner: str | None) -> str:
    return f"`{owner}({name}=...)`" if owner else f"`{name}`"


def _refuse(error: type[Exception], name: str, value: Any, owner: str | None, wanted: str, fix: str) -> Exception:
    message = f"{_label(name, owner)} must be {wanted}. Received: {name}={short_repr(value)}."
    return error(f"{message} {fix}" if fix else message)


def is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (for checks that test, such as of a loaded file's fields).

    A bool is an int to Python, but True given where a count belongs is a flag in the wrong place.
    """
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any, *, owner: str | None = None, optional: bool = False,
                       wanted: str | None = None, fix: str = "") -> Any:
    """Returns `value` when it is an int of at least 1 (or None, when `optional`).

    Args:
        name: The argument's name, as the caller spells it ("every_n_steps").
        value: The value received.
        owner: The class or function that received it ("Checkpointer"), named in the message as
            `Checkpointer(every_n_steps=...)`; None names the bare argument.
        optional: Also accept None.
        wanted: What the value must be, in the caller's words (default "a positive integer").
        fix: A sentence saying what to pass instead, appended to the message.

    Raises:
        ArgumentTypeError: for anything but an int (a bool, a float, a str).
        ValueError: for an int below 1.
    """
    return _check_int_at_least(1, "a positive integer", name, value, owner, optional, wanted, fix)


def check_non_negative_int(name: str, value: Any, *, owner: str | None = None, optional: bool = False,
                           wanted: str | None = None, fix: str = "") -> Any:
    """Returns `value` when it is an int of at least 0 (or None, when `optional`): a count or an index.

    Args and the message are as in `check_positive_int`; `wanted` defaults to "a non-negative integer".

    Raises:
        ArgumentTypeError: for anything but an int (a bool, a float, a str).
        ValueError: for a negative int.
    """
    return _check_int_at_least(0, "a non-negative integer", name, value, owner, optional, wanted, fix)


def _check_int_at_least(least: int, kind: str, name: str, value: Any, owner: str | None, optional: bool,
                        wanted: str | None, fix: str) -> Any:
    if value is None and optional:
        return None
    wanted = wanted or (f"{kind} or None" if optional else kind)
    if not is_int(value):
        raise _refuse(ArgumentTypeError, name, value, owner, wanted, fix)
    if value < least:
        raise _refuse(ValueError, name, value, owner, wanted, fix)
    return value


def check_positive_number(name: str, value: Any, *, owner: str | None = None, optional: bool = False,
                          wanted: str | None = None, fix: str = "") -> Any:
    """Returns `value` when it is an int or a float above 0, infinity too (or None, when `optional`).

    Args and the message are as in `check_positive_int`; `wanted` defaults to "a positive number".

    Raises:
        ArgumentTypeError: for anything but an int or a float (a bool, a str).
        ValueError: for 0, a negative number or NaN.
    """
    if value is None and optional:
        return None
    wanted = wanted or ("a positive number or None" if optional else "a positive number")
    if not (is_int(value) or isinstance(value, float)):
        raise _refuse(ArgumentTypeError, name, value, owner, wanted, fix)
    if math.isnan(value) or value <= 0:
        raise _refuse(ValueError, name, value, owner, wanted, fix)
    return value


def check_bool(name: str, value: Any, *, owner: str | None = None, optional: bool = False, fix: str = "") -> Any:
    """Returns `value` when it is True or False (or None, when `optional`).

    A truthy "yes" or 1 is refused: it would silently switch a mode that the caller meant to name.

    Raises:
        ArgumentTypeError: for anything else.
    """
    if isinstance(value, bool) or (value is None and optional):
        return value
    wanted = "True, False or None" if optional else "True or False"
    raise _refuse(ArgumentTypeError, name, value, owner, wanted, fix)


def describe_choices(choices: Iterable[Any]) -> str:
    """The allowed values as a message lists them: "'min' or 'max'", "one of 'a', 'b', 'c'"."""
    shown = [repr(choice) for choice in choices]
    return " or ".join(shown) if len(shown) <= 2 else "one of " + ", ".join(shown)


def _same(value: Any, choice: Any) -> bool:
    # By type first: True == 1, yet True is no choice among (0, 1), and an array's == is no bool.
    if isinstance(value, bool) != isinstance(choice, bool):
        return False
    return isinstance(value, type(choice)) and value == choice


def check_choice(name: str, value: Any, choices: Iterable[Any], *, owner: str | None = None, fix: str = "") -> Any:
    """Returns `value` when it is one of `choices` (compared with ==, so 'min' and not 'MIN').

    Example:
        >>> check_choice("mode", "sideways", ("min", "max"), owner="EarlyStop")
        ValueError: `EarlyStop(mode=...)` must be 'min' or 'max'. Received: mode='sideways'.

    Raises:
        ValueError: for any other value.
    """
    choices = tuple(choices)
    if any(_same(value, choice) for choice in choices):
        return value
    raise _refuse(ValueError, name, value, owner, describe_choices(choices), fix)
