"""The one walker over nested structures of tensors: batches, model outputs, gathered values, states.

A structure is a tensor, or a dict, list or tuple (namedtuples included; dataclasses on request)
of structures; anything else is a leaf that is not a tensor. Containers keep their type, so an
OrderedDict, a namedtuple or a defaultdict comes back as one.

    map_tensors      the structure with each tensor replaced by `fn(tensor)`
    iter_tensors     its tensors, depth first, in order
    is_tensor_tree   whether it is a tensor, or non-empty containers with only tensors at the leaves
"""

from __future__ import annotations

import copy
import dataclasses as _dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return _dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _rebuilt_dict(obj: dict, values: list[Any]) -> dict:
    """`obj`'s keys with `values`, in a container of `obj`'s type."""
    if type(obj) is dict:
        return dict(zip(obj, values))
    # A shallow copy, then the new values: keeps a subclass's extras (a defaultdict's factory), which
    # calling type(obj) with the pairs would lose or refuse.
    result = copy.copy(obj)
    for key, value in zip(obj, values):  # the same keys, so the order stays
        result[key] = value
    return result


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any, *, other: Callable[[Any], Any] | None = None,
                dataclasses: bool = False) -> Any:
    """Returns `data` with each tensor inside it replaced by `fn(tensor)`; containers keep their type.

    Args:
        fn: Applied to every tensor (subclasses such as DTensor and Parameter too).
        data: A tensor, or dicts, lists, tuples and namedtuples of them, nested to any depth.
        other: Applied to every leaf that is not a tensor; by default such a leaf is kept as is.
            Raise in it to refuse such leaves (collectives cannot send a str).
        dataclasses: Also walk dataclass instances (rebuilt with `dataclasses.replace`, from
            their init fields); otherwise a dataclass is a leaf.

    Example:
        >>> map_tensors(lambda t: t.to("cuda"), {"x": x, "y": [y1, y2]})
    """
    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return fn(obj)
        if isinstance(obj, dict):
            return _rebuilt_dict(obj, [walk(value) for value in obj.values()])
        if _is_namedtuple(obj):
            return type(obj)(*(walk(value) for value in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(value) for value in obj)
        if dataclasses and _is_dataclass_instance(obj):
            changes = {f.name: walk(getattr(obj, f.name)) for f in _dataclasses.fields(obj) if f.init}
            return _dataclasses.replace(obj, **changes)
        return obj if other is None else other(obj)

    return walk(data)


def iter_tensors(data: Any) -> Iterator[torch.Tensor]:
    """Yields every tensor inside `data` (dicts' values, lists, tuples), depth first, in order.

    Example:
        >>> next(iter_tensors(batch), None)  # the first tensor of a batch, or None
    """
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from iter_tensors(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from iter_tensors(value)


def is_tensor_tree(data: Any) -> bool:
    """Whether `data` is a tensor, or a non-empty dict, list or tuple whose every item is one in turn.

    Such a structure can be concatenated, gathered or cut leaf by leaf; a tree with a str, a None
    or an empty container in it cannot.
    """
    if isinstance(data, torch.Tensor):
        return True
    items = data.values() if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else None
    return bool(items) and all(is_tensor_tree(item) for item in items)
