"""How many batches each loop runs: `limit_*_batches`, `overfit_batches` and `fast_dev_run`.

Lightning's arguments and rules, resolved once when the Trainer is built (`LoopLimits.resolve`):

- `limit_{train,val,test,predict}_batches`: None runs every batch; an int n runs the first n batches
  of each epoch (train) or loop (val, test, predict), 0 skipping the loop; a float f in [0, 1] runs
  `int(f * len(loader))` of them (Lightning's rounding, on this process's prepared loader, so per
  process), and refuses a fraction that rounds to 0 or a loader without a length (a stream) unless f
  is 1.0. An integral float above 1 counts as that int, as in Lightning.
- `overfit_batches`: 0 is off; else it is the train and the val limit both (the limit_ arguments
  given beside it are overridden, with a warning), and both loaders are read in order
  (`sequential_loader`): every epoch trains on the same first batches.
- `fast_dev_run`: n (True is 1) batches of training, validation, test and predict, max_steps=n in
  one epoch, no sanity check; the Trainer mutes the callbacks that save checkpoints or write logs
  and prints one line saying so (`dev_run_line`).

A limited training epoch is the first n batches of the epoch's order (`epoch_slice`): its last
batch closes the accumulation window as a loader's last batch does, and the loader then moves on
to the next epoch, so checkpoints inside it resume exactly. Nothing here runs per batch unless a
limit shortens the loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Iterator

from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from fittrain.common.checks import ArgumentTypeError, check_non_negative_int, is_int
from fittrain.common.reprs import short_repr
from fittrain.trainer.parts import length_of

#: A loop's limit as given: None (all), an int count, or a float fraction in [0, 1].
Limit = int | float | None
STAGES = ("train", "val", "test", "predict")


def check_limit(name: str, value: Any, off: Any = None) -> Limit:
    """Returns a `limit_*_batches` (or `overfit_batches`) value: None (or `off`), an int >= 0, or a
    float in [0, 1]; an integral float above 1 becomes that int (Lightning's rule).

    Raises:
        ArgumentTypeError: for a bool or anything not a number.
        ValueError: for a negative number or a fraction above 1 that is not a whole number.
    """
    wanted = "None, an int >= 0 (a number of batches) or a float in [0.0, 1.0] (a fraction of the loader)"
    if value is off:
        return value
    if not (is_int(value) or isinstance(value, float)):
        raise ArgumentTypeError(f"`Trainer({name}=...)` must be {wanted}. Received: {name}={short_repr(value)} "
                                f"({type(value).__name__}).")
    if isinstance(value, float) and value > 1 and value.is_integer():
        return int(value)
    if value < 0 or (isinstance(value, float) and (math.isnan(value) or value > 1)):
        raise ValueError(f"`Trainer({name}=...)` must be {wanted}. Received: {name}={value!r}. Pass e.g. {name}=10 "
                         f"for 10 batches or {name}=0.25 for a quarter of them.")
    return value


def check_fast_dev_run(value: Any) -> int:
    """Returns `fast_dev_run` as a count of batches: False -> 0 (off), True -> 1, an int n >= 0 -> n.

    Raises:
        ArgumentTypeError: for anything but a bool or an int.
        ValueError: for a negative int.
    """
    if isinstance(value, bool):
        return int(value)
    return check_non_negative_int("fast_dev_run", value, owner="Trainer", wanted="True, False or an int >= 0", fix=(
        "Pass fast_dev_run=True for one batch of each loop, or n for n batches."))


def check_sanity_steps(value: Any) -> int | None:
    """Returns `num_sanity_val_steps`: an int >= 0, or None for -1 (the whole validation loader).

    Raises:
        ArgumentTypeError, ValueError: for anything but an int >= -1.
    """
    if value == -1 and is_int(value):
        return None
    return check_non_negative_int("num_sanity_val_steps", value, owner="Trainer", wanted="an int >= -1", fix=(
        "Pass 0 for no sanity check, n for n validation batches before training, -1 for the whole val loader."))


@dataclasses.dataclass(frozen=True)
class LoopLimits:
    """The batches each loop runs, resolved from the Trainer's arguments (see the module docstring).

    Attributes:
        train, val, test, predict: Each loop's limit: None, an int or a float fraction.
        overfit: `overfit_batches` (0 when off): the loaders of fit are read in order.
        dev_run: `fast_dev_run`'s number of batches (0 when off).
        sanity: Validation batches of the sanity check before training (0: none; None: all of the
            limited val loader).
        overridden: The arguments that `fast_dev_run` or `overfit_batches` overrode, as given, for messages.
    """

    train: Limit = None
    val: Limit = None
    test: Limit = None
    predict: Limit = None
    overfit: int | float = 0
    dev_run: int = 0
    sanity: int | None = 0
    overridden: tuple[str, ...] = ()

    @classmethod
    def resolve(cls, limits: dict[str, Any], overfit_batches: Any, fast_dev_run: Any,
                num_sanity_val_steps: Any, warn: Callable[[str], None]) -> "LoopLimits":
        """Checks the Trainer's arguments and applies Lightning's precedence: overfit_batches sets the
        train and val limits, fast_dev_run every other one and turns the sanity check off.

        Args:
            limits: `{"train": limit_train_batches, "val": ..., "test": ..., "predict": ...}`.
            overfit_batches, fast_dev_run, num_sanity_val_steps: The Trainer's arguments.
            warn: Called with a warning when overfit_batches overrides a limit given beside it.
        """
        checked = {stage: check_limit(f"limit_{stage}_batches", value) for stage, value in limits.items()}
        overfit = check_limit("overfit_batches", overfit_batches, off=0)
        dev_run = check_fast_dev_run(fast_dev_run)
        sanity = check_sanity_steps(num_sanity_val_steps)
        # overfit_batches sets the train and val limits; fast_dev_run every limit that overfit_batches does not.
        replaced = ({"train", "val"} if overfit else set()) | (set(STAGES) if dev_run else set())
        overridden = tuple(f"limit_{stage}_batches={checked[stage]!r}" for stage in STAGES
                           if stage in replaced and checked[stage] is not None)
        if overfit:
            given = [name for name in overridden if name.startswith(("limit_train", "limit_val"))]
            if given:
                warn(f"Trainer(overfit_batches={overfit!r}) trains and validates on the first {overfit!r} batches, "
                     f"overriding {', '.join(given)}.")
            checked["train"] = checked["val"] = overfit
        if dev_run:
            checked.update({stage: dev_run for stage in STAGES if not (overfit and stage in ("train", "val"))})
            sanity = 0
        return cls(**checked, overfit=overfit, dev_run=dev_run, sanity=sanity, overridden=overridden)


def batches_to_run(name: str, limit: Limit, loader: Any) -> int | None:
    """The batches a loop runs on `loader` under `limit`, or None for all of them (no limit needed).

    Args:
        name: The limit's argument, for messages ("limit_val_batches").
        limit: The limit (see `LoopLimits`).
        loader: The prepared loader, whose length is this process's.

    Raises:
        ValueError: for a fraction of a loader without a length, or one that rounds to 0 batches.
    """
    if limit is None:
        return None
    length = length_of(loader)
    if is_int(limit):
        return limit if length is None or limit < length else None
    if length is None:
        if limit == 1.0:
            return None
        raise ValueError(
            f"`Trainer({name}={limit!r})` is a fraction of the loader's length, and this loader has none (a stream, "
            f"or an IterableDataset). Received: {short_repr(getattr(loader, 'base_loader', loader))}. Pass an int "
            f"number of batches instead, such as {name}=100.")
    count = int(length * limit)
    if count == 0 and limit > 0:
        raise ValueError(
            f"`Trainer({name}={limit!r})` is less than one batch of this loader's {length}: {limit!r} * {length} < 1. "
            f"Pass at least {name}={1 / length!r}, or an int number of batches.")
    return count if count < length else None


def counted(limited: int | None, loader: Any) -> int | float:
    """The batches a loop runs, for `trainer.num_*_batches`: `limited`, else the loader's length
    (inf for a stream, as in Lightning)."""
    if limited is not None:
        return limited
    length = length_of(loader)
    return math.inf if length is None else length


def limited(batches: Iterable[Any], count: int | None) -> Iterator[Any]:
    """The first `count` items of `batches` (all of them for None); the pass is closed as soon as
    `count` were taken, so a prepared loader's accumulation flags stop applying."""
    if count is None:
        yield from batches
        return
    iterator = iter(batches)
    try:
        for _ in range(count):
            try:
                yield next(iterator)
            except StopIteration:
                return
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def epoch_slice(loader: Any, start: int, count: int) -> Iterator[Any]:
    """Batches `start`..`count - 1` of the current epoch of the prepared train `loader`.

    The last one ends the data for gradient accumulation (a window closes there, as at a loader's
    end), and once it is done the loader moves on to the next epoch, as after a whole pass; so a
    checkpoint saved inside the slice resumes exactly, and one saved after its last batch starts the
    next epoch. A loader that runs out sooner (a short stream) ends the epoch itself.
    """
    position = loader.position
    epoch = position.epoch
    if start < count:
        gradient_state, flags = loader.gradient_state, None
        iterator = loader.iterate(skip=start)
        try:
            for index in range(start, count):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return  # the pass ended by itself: the loader is at the next epoch already
                if flags is None:
                    # Pushed after the loader's own pass began, so these flags are the innermost: they say
                    # where this epoch's data ends, for `accumulate`.
                    flags = gradient_state.begin_pass(loader)
                flags.end_of_dataloader = index == count - 1
                yield batch
        finally:
            if flags is not None:
                gradient_state.end_pass(flags)
            iterator.close()
    if position.epoch == epoch:
        position.begin_epoch(epoch + 1)


def sequential_loader(name: str, loader: Any, warn: Callable[[str], None]) -> Any:
    """`loader` read in order, for `overfit_batches`: a DataLoader whose sampler shuffles is rebuilt
    with a `SequentialSampler`, with a warning (Lightning's); other loaders are returned as they are.

    Raises:
        ValueError: for a DataLoader that cannot be rebuilt with another sampler: a subclass, or one
            with a custom batch_sampler.
    """
    if not isinstance(loader, DataLoader) or length_of(loader) is None:
        return loader  # a list of batches or a stream: read in order already
    custom_batches = loader.batch_size is None and loader.batch_sampler is not None
    order = loader.batch_sampler if custom_batches else loader.sampler
    if type(order) is BatchSampler:
        order = order.sampler
    if isinstance(order, SequentialSampler):
        return loader
    if type(loader) is not DataLoader or custom_batches:
        what = f"a {type(loader).__name__}" if type(loader) is not DataLoader else "a DataLoader with a batch_sampler"
        raise ValueError(
            f"Trainer(overfit_batches=...) reads `{name}` in order, and {what} cannot be rebuilt with a "
            f"SequentialSampler. Received: {name}={short_repr(loader)}. Pass a DataLoader(dataset, batch_size=..., "
            "shuffle=False) (or a sampler that does not shuffle), or use limit_train_batches instead.")
    warn(f"Trainer(overfit_batches=...) reads `{name}` in order: its {type(loader.sampler).__name__} is replaced by "
         "a SequentialSampler (pass shuffle=False to silence this).")
    options = dict(batch_size=loader.batch_size, drop_last=loader.drop_last, collate_fn=loader.collate_fn,
                   num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
                   worker_init_fn=loader.worker_init_fn, generator=loader.generator)
    if loader.num_workers > 0:
        options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                       multiprocessing_context=loader.multiprocessing_context)
    return DataLoader(loader.dataset, sampler=SequentialSampler(loader.dataset), **options)


def dev_run_line(limits: LoopLimits, overridden: list[str]) -> str:
    """The one line a `fast_dev_run` Trainer prints: what runs, and the arguments given that it overrides
    (`overridden`: the Trainer's own, such as "max_epochs=10"; the limits are added here)."""
    n = limits.dev_run
    train = f"{limits.train!r} batch(es) per epoch" if limits.overfit else f"{n} batch(es)"
    text = (f"Running in fast_dev_run mode: at most {n} optimizer step(s) in one epoch ({train} of training), {n} "
            "batch(es) of validation, test and predict, no sanity check; callbacks that save checkpoints or write "
            "logs do not run.")
    given = [*overridden, *limits.overridden]
    return text + (f" Overrides {', '.join(given)}." if given else "")
