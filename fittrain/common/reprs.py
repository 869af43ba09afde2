"""`short_repr`: the value an argument received, as error messages quote it."""

from __future__ import annotations

from typing import Any


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` when it is one line of at most `limit` characters, else `<TypeName>`.

    A message quotes small values exactly (`every_n_steps=0`, `tensor(0.5000)`); a model, a big
    tensor or a loader would bury the message in pages of repr, and its type is what the reader
    needs to recognise it.
    """
    text = repr(value)
    return text if len(text) <= limit and "\n" not in text else f"<{type(value).__name__}>"
