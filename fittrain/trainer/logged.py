"""`self.log` with Lightning's options: where a logged value goes, and how it is reduced over the
batches of an epoch and over processes.

Where `self.log(name, value, ...)` is called decides its defaults, as in Lightning:

- **in a training batch** (`training_step`, the batch hooks, backward hooks): `on_step=True`,
  `on_epoch=False`. A step value is `trainer.state.metrics[name]` at once. With `on_epoch=True` it
  is also reduced over the epoch's batches (`reduce_fx`: "mean" weighted by batch size, "sum",
  "max", "min") and recorded when the epoch's batches and validation are done, just before
  `on_train_epoch_end`. Both: the names are `name_step` and `name_epoch`, and `name` holds the
  latest of the two. The running reductions are saved in checkpoints, so a resumed epoch ends
  with the same value.
- **in an evaluation loop** (`validation_step`, `test_step`, their batch hooks): the value's mean
  over every sample of the loop, on every process (fittrain/trainer/evaluation.py); `on_step=True`
  or another `reduce_fx` is refused there.
- **elsewhere** (`on_train_epoch_end`, `on_validation_epoch_end`, `on_fit_start`, ...): the value
  itself; `on_step=True` is refused.

`sync_dist=True` reduces across processes with `reduce_fx` ("mean" by default): epoch values once
per epoch, all of them in one collective per reduction; step values once per batch, all of them
together, right after the batch's optimization and before `on_train_batch_end` (a step value
logged later in that batch is reduced with the next batch's); values logged elsewhere at once.
Every process must log the same names with `sync_dist=True`, as in Lightning. Evaluation
metrics are always reduced across processes, once per loop.

`prog_bar=True` shows the value on the progress bar; `logger=False` keeps it out of the Logger's
trackers (it still is in `trainer.state.metrics`, for callbacks). A torchmetrics `Metric` object is
logged as Lightning logs it: fittrain/trainer/metric_objects.py.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from fittrain.common.reprs import short_repr
from fittrain.data import batch_size_of
from fittrain.distributed import collectives
from fittrain.trainer.metric_objects import MetricObjects, as_metric

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

#: reduce_fx names, and the torch functions Lightning programs pass instead.
REDUCTIONS = ("mean", "sum", "max", "min")
_FUNCTIONS: dict[Callable[..., Any], str] = {torch.mean: "mean", torch.sum: "sum", torch.max: "max",
                                              torch.min: "min"}
#: What a process that logged nothing of a name contributes to its reduction across processes: nothing.
_IDENTITY = {"max": float("-inf"), "min": float("inf")}


@dataclasses.dataclass
class Running:
    """One metric's reduction over the epoch's batches so far.

    A batch only appends its value (no device work on the per-step path); `fold` reduces what was
    appended, in order, in Python floats (IEEE doubles), after one copy to the CPU. The fold is the
    same sequence of operations however the epoch is cut by checkpoints, so a resumed epoch ends
    with the bitwise same value; a checkpoint holds the folded (value, weight).
    """

    reduce_fx: str
    sync: bool
    value: float | None = None  # the weighted sum ("mean"), the sum, or the extreme; None before any
    weight: float = 0.0  # the summed batch sizes ("mean")
    pending: list[tuple[torch.Tensor, float]] = dataclasses.field(default_factory=list)

    def fold(self) -> None:
        """Reduces the appended values into `value` and `weight` (`fold_all` does several at once)."""
        fold_all((self,))

    def fold_floats(self, values: list[float]) -> None:
        """Folds the appended values, given as floats in their order, into `value` and `weight`: a
        left fold, one value at a time, so cutting it anywhere gives the bitwise same result."""
        fx, total, weight = self.reduce_fx, self.value, self.weight
        if fx == "mean":
            total = 0.0 if total is None else total
            for v, (_, w) in zip(values, self.pending):
                total += v * w
                weight += w
        elif fx == "sum":
            total = 0.0 if total is None else total
            for v in values:
                total += v
        else:
            pick = max if fx == "max" else min
            for v in values:
                total = v if total is None else pick(total, v)
        self.value, self.weight, self.pending = total, weight, []

    def result(self) -> float:
        self.fold()
        return self.value / self.weight if self.reduce_fx == "mean" else self.value


def fold_all(runnings: Iterable[Running]) -> None:
    """Folds the values each running reduction appended, copied to the CPU together: one stack and one
    device sync per device and dtype (a metric's values share both), not one per metric. Values on the
    CPU are read one by one instead, which costs less than stacking them."""
    groups: dict[tuple[torch.device, torch.dtype], list[Running]] = {}
    for running in runnings:
        if running.pending:
            first = running.pending[0][0]
            groups.setdefault((first.device, first.dtype), []).append(running)
    for (device, _), group in groups.items():
        tensors = [v for running in group for v, _ in running.pending]
        values = [v.item() for v in tensors] if device.type == "cpu" else torch.stack(tensors).double().cpu().tolist()
        start = 0
        for running in group:
            end = start + len(running.pending)
            running.fold_floats(values[start:end])
            start = end


def check_reduce_fx(reduce_fx: Any) -> str:
    """`reduce_fx` as one of `REDUCTIONS` (a torch function such as torch.mean is accepted too).

    Raises:
        ValueError: for anything else.
    """
    name = _FUNCTIONS.get(reduce_fx, reduce_fx) if callable(reduce_fx) else reduce_fx
    if name not in REDUCTIONS:
        raise ValueError(f"self.log(reduce_fx=...) must be one of {', '.join(REDUCTIONS)} (or torch.mean, torch.sum, "
                         f"torch.max, torch.min). Received: reduce_fx={short_repr(reduce_fx)}.")
    return name


class MetricLog:
    """What `self.log` recorded in the current fit beyond the values themselves: the epoch's running
    reductions, the step values waiting to be reduced across processes, and the names to show on
    the progress bar or keep from the trackers. The Trainer owns one and resets it at each fit.

    Args:
        trainer: The Trainer, whose state, evaluation and accelerator it reads.
    """

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.prog_bar: set[str] = set()  # names the progress bar shows
        self.hidden: set[str] = set()  # names the Logger's trackers never get
        self.epoch_names: list[str] = []  # what the last end_epoch recorded (the Logger writes them then)
        self._pending: dict[str, str] = {}  # step values to reduce across processes after the batch: name -> fx
        # The (epoch, batch_idx) of the last batch whose optimization ended: a sync_dist step value logged
        # in another batch waits for `end_batch`, one logged after it (on_train_batch_end) is reduced at once.
        self._ended: tuple[int, int] | None = None
        # The training batch's size, found at its first on_epoch value, and that batch (until end_batch).
        self._batch_weight: float | None = None
        self._weighed: Any = None
        # The tensor the batch logged last and its detached self: a value logged under several names, or
        # logged and then returned as the loss (Lightning's usual step), is detached once.
        self._last_logged: Any = None
        self._last_detached: Any = None
        # A training batch's self.log options, checked once: (name, options) -> what `_plan` returns.
        self._plans: dict[tuple[Any, ...], tuple[tuple[str, ...], str | None, str]] = {}
        self.objects = MetricObjects(trainer)  # torchmetrics Metric objects logged: fittrain/trainer/metric_objects.py

    # ----------------------------------------------------------------- the loop's calls
    def end_batch(self) -> None:
        """Reduces the batch's sync_dist step values across processes: one collective per reduction.
        The loop calls it after each batch's optimization; nothing is needed when a batch starts."""
        state = self.trainer.state
        self._ended = (state.epoch, state.batch_idx)
        self._last_logged = self._weighed = None  # neither the batch's graph nor the batch is kept past it
        if self._pending:
            pending, self._pending = self._pending, {}
            self._reduce_into_metrics(pending)

    def end_epoch(self) -> None:
        """Records the epoch's running reductions (`name` or `name_epoch`), reduced across processes
        where asked, and starts the next epoch's. With several processes one small gather runs here
        every epoch, so that no process skips a reduction another one makes."""
        self.trainer.batch = None  # after the epoch's batches, self.log is epoch-level (`elsewhere`)
        self.end_batch()
        state, acc = self.trainer.state, self.trainer.accelerator
        running, state.epoch_logs = state.epoch_logs, {}
        fold_all(running.values())
        values = {name: r.result() for name, r in running.items()}
        metric_values = self.objects.end_epoch()
        if acc.num_processes > 1:
            mine = [(name, r.reduce_fx) for name, r in running.items() if r.sync]
            gathered = collectives.gather_object(mine, acc.state)
            wanted = dict(sorted({tuple(item) for items in gathered for item in items}))
            for name, fx in wanted.items():  # a name another process logged and this one did not adds nothing
                if name not in running:
                    running[name] = Running(fx, True, _IDENTITY.get(fx, 0.0))
                    values[name] = running[name].value
            self._reduce(values, wanted, running)
        self.epoch_names = []
        for name, value in {**values, **metric_values}.items():
            self._record_epoch_value(name, value)

    # ----------------------------------------------------------------- self.log
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: Any = "mean", sync_dist: bool = False,
            batch_size: int | None = None) -> None:
        """Records `value` under `name` as the module docstring says.

        Raises:
            ValueError: for an option the place of the call cannot honour, or a value that is not a scalar.
        """
        trainer = self.trainer
        if trainer.batch is None or trainer.evaluation.running:
            self._log_elsewhere(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size)
            return
        # In a training batch, the per-step path: the options are checked once per (name, options), and
        # a repeated call is a few dict stores and a list append.
        key = (name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
        try:
            plan = self._plans[key]
        except (KeyError, TypeError):  # a TypeError: an unhashable option, which _plan refuses by name
            plan = self._plan(name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
            self._plans[key] = plan
        step_names, epoch_name, fx = plan
        # A 0-d tensor is the usual value, and a loss (an autograd result, not a view) the usual tensor:
        # detached here, without a call, once (see `record_loss`). Nothing changes a loss in place later.
        if type(value) is torch.Tensor and not value.ndim and not value.is_leaf and value._base is None:
            if value is not self._last_logged:
                self._last_logged, self._last_detached = value, value.detach()
            value = self._last_detached
        elif (metric := as_metric(value)) is not None:
            if epoch_name in trainer.state.epoch_logs:  # a tensor logged under that name earlier in the epoch
                _refuse_another_kind(epoch_name, trainer.state.epoch_logs[epoch_name], "a torchmetrics Metric")
            self.objects.log_step(name, metric, step_names, epoch_name)
            return
        else:
            value = _scalar(name, value)
        if step_names:
            metrics = trainer.state.raw_metrics
            for step_name in step_names:  # name_step and name, or name
                metrics[step_name] = value
            if sync_dist:
                self._sync_step_value(step_names[0], fx)
        if epoch_name is not None:
            if batch_size is not None:
                weight = float(batch_size)
            elif self._weighed is not trainer.batch:
                self._weighed = trainer.batch
                weight = self._batch_weight = _batch_weight(trainer.batch)
            else:
                weight = self._batch_weight
            running = trainer.state.epoch_logs.get(epoch_name)
            if running is None or running.reduce_fx != fx or running.sync != sync_dist:
                running = self._start_running(epoch_name, running, fx, sync_dist)
            running.pending.append((value, weight))

    def record_loss(self, loss: torch.Tensor) -> None:
        """Records the batch's loss, detached, as `state.loss` and the metric "train_loss"; a loss this
        batch logged last is detached once, not twice (`self.log("loss", loss); return loss`)."""
        state = self.trainer.state
        state.loss = state.raw_metrics["train_loss"] = (
            self._last_detached if loss is self._last_logged else loss.detach())

    def _plan(self, name: str, prog_bar: bool, logger: bool, on_step: bool | None, on_epoch: bool | None,
              reduce_fx: Any, sync_dist: bool) -> tuple[tuple[str, ...], str | None, str]:
        """Checks a training batch's options once and sets their flags: (the names a step value is
        recorded under, the epoch value's name or None, the reduction)."""
        fx = check_reduce_fx(reduce_fx)
        step = True if on_step is None else bool(on_step)
        epoch = bool(on_epoch)
        _refuse(name, not (step or epoch), "on_step=False and on_epoch=False record nothing: set one of them")
        step_name, epoch_name = (f"{name}_step", f"{name}_epoch") if step and epoch else (name, name)
        if step and epoch:
            self.hidden.add(name)  # the trackers get name_step and name_epoch, as Lightning's loggers do
        if step:
            self._flags(step_name, prog_bar, logger)
        if epoch:
            self._flags(epoch_name, prog_bar, logger)
        step_names = ((step_name, name) if step_name != name else (name,)) if step else ()
        return step_names, epoch_name if epoch else None, fx

    def _log_elsewhere(self, name: str, value: Any, prog_bar: bool, logger: bool, on_step: bool | None,
                       on_epoch: bool | None, reduce_fx: Any, sync_dist: bool, batch_size: int | None) -> None:
        """`self.log` outside a training batch: a loop mean in evaluation, else the value itself."""
        fx = check_reduce_fx(reduce_fx)
        metric = as_metric(value)
        value = _scalar(name, value) if metric is None else metric
        trainer = self.trainer
        evaluation = trainer.evaluation
        if evaluation.averager is not None:
            _refuse(name, on_step is True or on_epoch is False or fx != "mean",
                    "in validation_step and test_step, fittrain records the mean of each value over every sample of "
                    "the loop (Lightning's defaults there; a Metric's compute() at the loop's end): leave on_step, "
                    "on_epoch and reduce_fx at their defaults")
            self._flags(name, prog_bar, logger)
            evaluation.averager.log(name, value, batch_size)
            return
        _refuse(name, on_step is True, "outside a training batch (an epoch hook) there is no step to log at: "
                                       "leave on_step at its default")
        if metric is not None:  # computed now, reset at the loop's or the training epoch's end, as in Lightning
            self._flags(name, prog_bar, logger)
            if evaluation.running:
                evaluation.reset_later(metric)
            trainer.state.raw_metrics[name] = self.objects.compute_now(name, metric, not evaluation.running)
            return
        if sync_dist:
            value = trainer.accelerator.reduce(value, reduction=fx)
        self._flags(name, prog_bar, logger)
        trainer.state.raw_metrics[name] = value

    # ----------------------------------------------------------------- helpers
    def _flags(self, name: str, prog_bar: bool, logger: bool) -> None:
        if prog_bar:
            self.prog_bar.add(name)
        if not logger:
            self.hidden.add(name)

    def _sync_step_value(self, name: str, fx: str) -> None:
        """Reduces a sync_dist step value across processes: with the batch's others after its optimization,
        or at once when logged after that (in on_train_batch_end)."""
        state = self.trainer.state
        if self._ended != (state.epoch, state.batch_idx):
            self._pending[name] = fx
        else:
            self._reduce_into_metrics({name: fx})

    def _start_running(self, name: str, running: Running | None, fx: str, sync: bool) -> Running:
        """The epoch's first value of `name`: its running reduction; other options than before are refused."""
        if running is not None or name in self.objects.epoch:
            _refuse_another_kind(name, running, f"reduce_fx={fx!r}, sync_dist={sync}")
        running = self.trainer.state.epoch_logs[name] = Running(fx, sync)
        return running

    def _record_epoch_value(self, name: str, value: Any) -> None:
        metrics = self.trainer.state.raw_metrics
        metrics[name] = float(value)
        self.epoch_names.append(name)
        if name.endswith("_epoch"):
            metrics[name[:-len("_epoch")]] = metrics[name]

    def _reduce_into_metrics(self, names: dict[str, str]) -> None:
        metrics = self.trainer.state.raw_metrics
        values = {name: metrics[name] for name in names}
        self._reduce(values, names, None)
        for name, value in values.items():
            metrics[name] = value
            if name.endswith("_step"):
                metrics[name[:-len("_step")]] = value

    def _reduce(self, values: dict[str, torch.Tensor], names: dict[str, str],
                running: dict[str, Running] | None) -> None:
        """Reduces `values[name]` across processes with `names[name]`, one collective per reduction; a
        running mean is reduced as its weighted sum and weight, so unequal batches weigh right."""
        acc = self.trainer.accelerator
        for fx in REDUCTIONS:
            group = sorted(name for name, f in names.items() if f == fx)
            if not group:
                continue
            if fx == "mean" and running is not None:
                packed = torch.tensor([[running[n].value or 0.0, running[n].weight] for n in group],
                                      dtype=torch.float64, device=acc.device)
                total = acc.reduce(packed, reduction="sum").tolist()
                for name, (weighted, weight) in zip(group, total):
                    values[name] = weighted / weight
                continue
            packed = torch.stack([torch.as_tensor(values[n], dtype=torch.float64).reshape(()).to(acc.device)
                                  for n in group])
            reduced = acc.reduce(packed, reduction=fx)
            for i, name in enumerate(group):
                values[name] = reduced[i]


def _scalar(name: str, value: Any) -> torch.Tensor:
    """`value` as a detached 0-d tensor of its value now. A number (int, float, bool or a NumPy scalar,
    as Lightning takes) becomes a float one on the CPU.

    A tensor that may change in place after the call is copied: a parameter (the optimizer steps
    it), a buffer or an accumulator (a leaf), or a view of one; otherwise the epoch's values and the
    step value would all read its latest value. Lightning copies logged values too. An autograd
    result that is not a view (a loss, an accuracy computed with grad) is detached without a copy.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            may_change = value.is_leaf or value._base is not None
            value = value.detach() if value.ndim == 0 else value.detach().reshape(())
            return value.clone() if may_change else value
    elif isinstance(value, numbers.Real):
        return torch.scalar_tensor(float(value))  # torch.tensor costs 2.5x more for one number
    raise ValueError(f"self.log({name!r}, value) takes a number, a one-element tensor or a torchmetrics Metric. "
                     f"Received: {short_repr(value)} ({type(value).__name__}{tuple(getattr(value, 'shape', ()))}). "
                     "Log a scalar such as loss or acc.mean(), and a dict of them with self.log_dict.")


def _batch_weight(batch: Any) -> float:
    """The batch's size as an epoch mean's weight (1 for a batch without tensors): `batch_size_of`, with
    the usual batch, a tensor or a tuple or list whose first item is one, read without a search."""
    first = batch[0] if type(batch) in (tuple, list) and batch else batch
    if type(first) is torch.Tensor and first.ndim and first.shape[0]:
        return float(first.shape[0])
    return float(batch_size_of(batch) or 1)


def _refuse_another_kind(name: str, running: Running | None, now: str) -> None:
    """Refuses an epoch value logged with other options (`now`) than earlier in the epoch (`running`'s,
    or a torchmetrics Metric's when None)."""
    before = f"reduce_fx={running.reduce_fx!r}, sync_dist={running.sync}" if running else "a torchmetrics Metric"
    raise ValueError(f"self.log({name!r}, ...) was called with {now} after {before} in the same epoch. Pass the same "
                     "kind of value and options at every call.")


def _refuse(name: str, condition: bool, why: str) -> None:
    if condition:
        raise ValueError(f"self.log({name!r}, ...): {why}.")
