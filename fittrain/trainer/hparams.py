"""Hyperparameters: `save_hyperparameters()` records the calling `__init__`'s arguments in `hparams`.

One implementation for the module (`TrainModule`, hence LightningModule) and the datamodules:

- `save_hyperparameters(*names, ignore=...)` reads the arguments of the `__init__` that calls it;
  `hparams` then holds them (a dict whose keys read as attributes) and `hparams_initial` a copy
  of them as first recorded.
- Before it, `hparams` is an empty dict the program may fill, as in Lightning; like Lightning's,
  it is recorded nowhere: only saved hyperparameters go to trackers and checkpoints
  (`recordable`).
"""

from __future__ import annotations

import inspect
from types import FrameType
from typing import Any, Sequence

from fittrain.common.reprs import short_repr


class HParams(dict):
    """A dict whose keys read as attributes too: `self.hparams.lr` (Lightning's AttributeDict)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"hparams has no {name!r}; it holds {', '.join(self) or 'nothing'}.") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value  # `self.hparams.lr = 0.1`, as Lightning's AttributeDict takes it


def _get_hparams(owner: Any) -> HParams:
    saved = owner.__dict__.get("hparams")
    if saved is not None:
        return saved
    # Before save_hyperparameters: an empty dict, kept so that what the program puts in stays.
    return owner.__dict__.setdefault("_unsaved_hparams", HParams())


def _set_hparams(owner: Any, values: Any) -> None:
    owner.__dict__["hparams"] = HParams(values)
    owner.__dict__["_hparams_initial"] = dict(values)


#: `hparams` of a module or datamodule: what `save_hyperparameters` recorded, else an empty dict.
HPARAMS = property(_get_hparams, _set_hparams, doc="The hyperparameters `save_hyperparameters()` recorded "
                                                   "(an empty dict before).")
#: `hparams_initial`: a copy of `hparams` as `save_hyperparameters` first recorded them (Lightning's).
HPARAMS_INITIAL = property(lambda owner: HParams(owner.__dict__.get("_hparams_initial") or {}),
                           doc="A copy of the hyperparameters as save_hyperparameters() recorded them.")


def save_hyperparameters(owner: Any, caller: FrameType | None, names: Sequence[str],
                         ignore: Sequence[str] | str) -> None:
    """Records in `owner.hparams` the arguments of the `__init__` running in frame `caller`: all of
    them, or only `names`, minus `ignore`.

    Raises:
        RuntimeError: when `caller` is not an `__init__`.
        ValueError: for a name in `names` or `ignore` that `__init__` has no argument of.
    """
    kind = type(owner).__name__
    try:
        if caller is None or caller.f_code.co_name != "__init__":
            raise RuntimeError(f"{kind}.save_hyperparameters() records the arguments of the __init__ that calls it: "
                               "call it inside __init__, after super().__init__().")
        args = inspect.getargvalues(caller)
        given = {name: args.locals[name] for name in args.args[1:]}  # args[0] is self
        given.update(args.locals[args.keywords] if args.keywords else {})
    finally:
        del caller  # a frame kept alive would keep every local of __init__ alive
    ignored = {ignore} if isinstance(ignore, str) else set(ignore)
    unknown = sorted((set(names) | ignored) - set(given))
    if unknown:
        raise ValueError(f"{kind}.save_hyperparameters(): __init__ has no argument named {', '.join(unknown)}. Its "
                         f"arguments: {', '.join(given) or 'none'}.")
    owner.hparams = {name: given[name] for name in (names or tuple(given)) if name not in ignored}


def recordable(owner: Any) -> dict[str, Any] | None:
    """The saved `hparams` as checkpoints and trackers keep them (None when none were saved): numbers,
    strings, booleans, None, and lists and dicts of them as they are; anything else (a module, a
    tensor) as its one-line repr."""
    hparams = owner.__dict__.get("hparams")
    return {str(k): recordable_value(v) for k, v in hparams.items()} if isinstance(hparams, dict) else None


def recordable_value(value: Any, depth: int = 0) -> Any:
    """`value` as trackers, checkpoints and hparams.yaml keep it: numbers, strings, booleans, None, and
    lists and dicts of them (4 levels deep); anything else as its one-line repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and depth < 4:
        return [recordable_value(v, depth + 1) for v in value]
    if isinstance(value, dict) and depth < 4:
        return {str(k): recordable_value(v, depth + 1) for k, v in value.items()}
    return short_repr(value, 200)
