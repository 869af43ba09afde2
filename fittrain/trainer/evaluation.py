"""The Trainer's evaluation loops: averaged metrics (validation, test) and gathered outputs (predict).

`Trainer.validate`, `Trainer.test`, `Trainer.predict` and the validations inside `fit` run their
batches in an `Evaluation` the Trainer owns; trainer.py keeps the public methods, which fire each
loop's start and end events and record the results. Every loop runs the module in eval mode, under
`torch.no_grad()` and the Accelerator's autocast, through the prepared model, so DDP and FSDP2
see a forward. A module that was not fitted is attached and prepared first (`Trainer._use_module`).

- Metrics: each process sums its own samples' values (weighted by batch size) and one collective
  at the end combines the processes (`ValidationAverager`). The loader is prepared with
  `even_batches=False`, so no sample is repeated and padding is never counted. Under FSDP2 a process
  that ran out repeats its last batch (every forward is a collective); that batch counts nowhere,
  and the module's torchmetrics Metrics get back the states they had before it.
- Test metric names (`as_test_metrics`): a scalar that `test_step` returns is `test_loss`; a name
  that starts with `val_` starts with `test_` instead (`val_acc` -> `test_acc`); a name that
  starts with `test_` stays; any other gets the prefix (`acc` -> `test_acc`).
- Prediction: the loader is prepared with `even_batches=True`, so every process takes a batch in
  every round, and each round's outputs are gathered with `gather_for_metrics`, which drops the
  samples that padded the last round. Process r holds the r-th part of each round (the r-th
  slice of a round of samples, or batch r of a round of ready batches), so the gathered rounds,
  concatenated, are in the loader's own order: the dataset's order for an unshuffled loader.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from fittrain.common.nested import is_tensor_tree, iter_tensors
from fittrain.common.reprs import short_repr
from fittrain.data import check_batches, send_to_device
from fittrain.trainer.events import Event
from fittrain.trainer.limits import limited
from fittrain.trainer.metric_objects import states_kept
from fittrain.trainer.module import TrainModule
from fittrain.trainer.parts import StepRunner, ValidationAverager, check_loader, length_of

if TYPE_CHECKING:
    from fittrain.accelerator.accelerator import Accelerator

_CPU = torch.device("cpu")
_PREDICT_FORMS = ("a tensor, or a dict, tuple or list of tensors, whose first dimension is the batch's samples; "
                  "or a list with one item per sample")


def check_fit_inputs(module: Any, train_loader: Any, val_loader: Any) -> None:
    """Refuses what `Trainer.fit` cannot train: not a TrainModule, a one-shot or empty train_loader, a
    val_loader for a module without validation_step."""
    if not isinstance(module, TrainModule):
        raise TypeError(f"fit() takes a TrainModule. Received: {type(module).__name__}. "
                        "Subclass fittrain.TrainModule and implement training_step and configure_optimizers.")
    check_loader("train_loader", train_loader)
    for name, loader in (("train_loader", train_loader), ("val_loader", val_loader)):
        if loader is not None and not isinstance(loader, DataLoader):
            check_loader(name, loader)
            check_batches(loader, name)
    if length_of(train_loader) == 0:  # a stream has no length: an empty epoch is caught when it runs
        raise ValueError("fit() received an empty train_loader (0 batches): nothing to train on. "
                         "Check the dataset's length and the loader's batch_size/drop_last.")
    if val_loader is not None and not module.has_validation_step():
        module.validation_step(None)  # raises the explanatory NotImplementedError


def check_inputs(method: str, module: Any, loader: Any) -> None:
    """Refuses a module that is not a TrainModule and a loader that cannot be iterated each time.

    Raises:
        TypeError: naming `Trainer.<method>()`, the argument and what was received.
    """
    if not isinstance(module, TrainModule):
        raise TypeError(f"Trainer.{method}() takes a TrainModule. Received: module={short_repr(module)} "
                        f"({type(module).__name__}). Subclass fittrain.TrainModule.")
    try:
        check_loader("loader", loader)
        if not isinstance(loader, DataLoader):
            check_batches(loader, "loader")
    except TypeError as err:
        raise TypeError(f"Trainer.{method}(): {err}") from None


class Evaluation:
    """The evaluation loops of one Trainer: averaged metrics (validation, test) and gathered outputs
    (predict). It returns what it computed; the Trainer records it and fires the loop's start and end.

    Args:
        accelerator: Prepares the loaders, autocasts, reduces and gathers.
        fire: Fires an event with the Trainer (`Event.VALIDATION_BATCH_END` and the like).

    Attributes:
        averager: Where `self.log` values go while a loop runs (`Trainer.record`), else None.
        batch, batch_idx, outputs: The batch being evaluated, its index in the loop, and what the
            step returned for it (the module's hooks receive them: fittrain/trainer/module_hooks.py).
    """

    def __init__(self, accelerator: "Accelerator", fire: Callable[[Event], None]) -> None:
        self.accelerator = accelerator
        self.averager: ValidationAverager | None = None
        self.batch: Any = None
        self.batch_idx = 0
        self.outputs: Any = None
        self.running = False  # from the loop's start event to its end event (`loop`)
        self._to_reset: dict[int, Any] = {}  # torchmetrics Metrics logged in the loop: reset as it ends
        self._fire = fire
        # One prepared loader per (loader, padding rule), so repeated calls don't pile up data positions.
        self._loaders: dict[tuple[int, bool], Any] = {}

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """Marks an evaluation loop running, its start and end events included (`self.log` there is
        epoch-level: fittrain/trainer/logged.py)."""
        self.running = True
        try:
            yield
        finally:
            self.running = False
            # After the loop's end hooks, as Lightning does: on_validation_epoch_end may still read them.
            to_reset, self._to_reset = self._to_reset, {}
            for metric in to_reset.values():
                metric.reset()

    def reset_later(self, metric: Any) -> None:
        """Resets a torchmetrics Metric logged in this loop when the loop ends."""
        self._to_reset[id(metric)] = metric

    def prepare_loader(self, loader: Any, even_batches: bool = False) -> Any:
        """The prepared evaluation loader, built once per loader and padding rule."""
        key = (id(loader), even_batches)
        cached = self._loaders.get(key)
        if cached is None or cached.base_loader is not loader:
            cached = self.accelerator.prepare_data_loader(loader, even_batches=even_batches)
            self._loaders[key] = cached
        return cached

    @contextlib.contextmanager
    def _evaluating(self, module: nn.Module) -> Iterator[None]:
        """Eval mode and no_grad; the module's mode and `averager` restored on exit, also on error."""
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.averager = None
            module.train(was_training)

    def average(self, runner: StepRunner, loader: Any, method: str, events: tuple[Event, Event],
                limit: int | None = None) -> dict[str, float]:
        """Runs `module.<method>(batch)` on every batch (the first `limit` of this process's, when
        given: limit_val_batches and the like) and returns its metrics averaged over every sample of
        every process, firing `events` (batch start, batch end) around each batch. All processes must
        call it."""
        acc = self.accelerator
        batch_start, batch_end = events
        averager = ValidationAverager(acc.device)
        if limit is not None:
            loader = limited(loader, limit)
        batches = _in_lockstep(loader, acc) if _forward_is_collective(acc, runner) else ((b, True) for b in loader)
        with self._evaluating(runner.module):
            for self.batch_idx, (batch, counted) in enumerate(batches):
                # A repeated batch only keeps this process in step with the others: it is not counted.
                target = self.averager = averager if counted else ValidationAverager(acc.device)
                self.batch = batch
                if counted:
                    self._fire(batch_start)
                target.start_batch(batch)
                with acc.autocast(), contextlib.nullcontext() if counted else states_kept(runner.module):
                    self.outputs = runner(method, batch, self.batch_idx)
                    target.add_output(self.outputs, method)
                if counted:
                    self._fire(batch_end)
        for metric in averager.metrics.values():
            self.reset_later(metric)
        return averager.result(acc)

    def predict(self, runner: StepRunner, loader: Any, limit: int | None = None) -> Any:
        """Runs `predict_step` on every batch of `loader` (prepared with even_batches=True; the first
        `limit` batches when given) and returns every sample's output once, in the loader's order,
        on the CPU, on every process."""
        acc, rounds = self.accelerator, []
        batches = loader if limit is None else limited(loader, limit)
        with self._evaluating(runner.module):
            for self.batch_idx, batch in enumerate(batches):
                self.batch = batch
                self._fire(Event.PREDICT_BATCH_START)
                with acc.autocast():
                    self.outputs = output = runner("predict_step", batch, self.batch_idx)
                _check_prediction(output)
                # Gathered per round while the loader still says which samples of it were padding.
                rounds.append(send_to_device(acc.gather_for_metrics(output), _CPU))
                self._fire(Event.PREDICT_BATCH_END)
        return concat_rounds(rounds)


def _forward_is_collective(acc: "Accelerator", runner: StepRunner) -> bool:
    return acc.distributed_strategy.forward_gathers_parameters(runner.model)


def _in_lockstep(loader: Any, acc: Any) -> Iterator[tuple[Any, bool]]:
    """(batch, counted) pairs until every process is out of batches: evaluation loaders are not
    padded (every sample counts once), so processes may hold different numbers of batches, and a
    process that ran out repeats its last batch, uncounted, while the others finish. One small
    all-reduce per batch, only where each forward is itself a collective (FSDP2)."""
    last, first = None, True
    for batch in itertools.chain(loader, itertools.repeat(None)):
        have = int(acc.reduce(torch.tensor([int(batch is not None)], device=acc.device)).item())
        if have == 0:
            return
        if first and have < acc.num_processes:
            # Every process sees the same count, so all raise alike instead of some waiting for the others.
            raise ValueError(
                f"An evaluation loader gave {acc.num_processes - have} of the {acc.num_processes} processes no batch "
                "at all; under FSDP2 every process takes part in each forward, so each needs a batch to repeat. "
                "Use at least batch_size * num_processes samples.")
        first = False
        if batch is not None:
            last = batch
        yield (batch, True) if batch is not None else (last, False)


def check_predictable(module: TrainModule) -> None:
    """Refuses a module that `Trainer.predict` cannot run: neither predict_step nor forward.

    Raises:
        TypeError: naming what to implement.
    """
    if not module.can_predict():
        raise TypeError(f"Trainer.predict() runs predict_step(self, batch), by default self(batch), and "
                        f"{type(module).__name__} implements neither predict_step nor forward. Implement one.")


def pick_test_method(module: TrainModule) -> str:
    """`test_step` when the module implements it, else `validation_step`.

    Raises:
        TypeError: when it implements neither.
    """
    if module.has_test_step():
        return "test_step"
    if module.has_validation_step():
        return "validation_step"
    raise TypeError(
        f"Trainer.test() runs test_step(self, batch), or validation_step(self, batch) when there is no test_step, "
        f"and {type(module).__name__} implements neither. Implement test_step returning a scalar (recorded as "
        "test_loss) or a dict of named scalars.")


def as_test_name(name: str) -> str:
    """The name a validation-style metric gets in `Trainer.test`'s results (see the module docstring)."""
    if name.startswith("test_"):
        return name
    return "test_" + (name[len("val_"):] if name.startswith("val_") else name)


def as_test_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` renamed by `as_test_name`.

    Raises:
        ValueError: when two names become one (such as `val_acc` and `acc`).
    """
    renamed: dict[str, float] = {}
    origin: dict[str, str] = {}
    for name, value in metrics.items():
        new = as_test_name(name)
        if new in renamed:
            raise ValueError(
                f"Trainer.test() would record both metrics {origin[new]!r} and {name!r} as {new!r} ('val_x' and "
                "'x' both become 'test_x', and a scalar return becomes 'test_loss'). Give them distinct names in "
                "test_step or validation_step and in self.log.")
        renamed[new], origin[new] = value, name
    return renamed


def _check_prediction(output: Any) -> None:
    """Refuses outputs whose samples cannot be told apart (so padding could not be dropped)."""
    if is_tensor_tree(output):
        for leaf in iter_tensors(output):
            if leaf.ndim == 0:
                raise ValueError(f"predict_step returned a 0-d tensor ({short_repr(leaf)}), which has no sample "
                                 f"dimension. Return {_PREDICT_FORMS}, e.g. one value per sample of shape (batch,).")
        return
    if not isinstance(output, (list, tuple)):
        raise TypeError(f"predict_step must return {_PREDICT_FORMS}. Received: {short_repr(output)} "
                        f"({type(output).__name__}).")


def concat_rounds(rounds: list[Any]) -> Any:
    """Joins the gathered rounds: tensors along dim 0, leaf by leaf; lists of items into one list."""
    if not rounds:
        return []
    first = rounds[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(rounds)
    if is_tensor_tree(first) and isinstance(first, dict):
        return type(first)((key, concat_rounds([r[key] for r in rounds])) for key in first)
    if is_tensor_tree(first):
        parts = [concat_rounds(list(leaf)) for leaf in zip(*rounds)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return [item for r in rounds for item in r]
