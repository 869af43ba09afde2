"""`short_repr`: the value an argument received, as error messages quote it."""

from __future__ import annotations

from typing import Any


def short_repr(value: Any, limit: int = 60) -> str:
    """`repr(value)` on one line when it fits in `limit` characters; else its start, cut, and its type.

    Tensors and arrays are described by dtype and shape, which is what a message about them needs
    (their repr is many lines of numbers).
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {dtype} {type(value).__name__} of shape {tuple(shape)}"
    text = repr(value).replace("\n", " ")
    if len(text) <= limit:
        return text
    return f"{text[:limit - 3]}... (a {type(value).__name__})"
