"""torchmetrics `Metric` objects given to `self.log`, with Lightning's semantics, and their states
in checkpoints.

`self.log("train_acc", self.train_acc)` after `self.train_acc(preds, target)`, Lightning's way:

- **in a training batch**: the step value is the metric's value on this batch (its `forward`'s
  result, `_forward_cache`; nothing when only `update()` ran); with `on_epoch=True` the epoch value
  is `metric.compute()` when the epoch's batches and validation are done, before
  `on_train_epoch_end`. Every metric logged in the epoch is `reset()` after `on_train_epoch_end`.
- **in validation_step / test_step**: `compute()` at the loop's end, then `reset()`.
- **in an epoch hook** (`on_validation_epoch_end`, `on_train_epoch_end`, ...): `compute()` at the call;
  `reset()` at the end of the evaluation loop or training epoch it belongs to.

torchmetrics reduces across processes itself in `compute()`, so `sync_dist` and `reduce_fx` do not
apply, and every process must log the same metrics.

Checkpoints keep the states of every Metric the module holds (`self.train_acc = BinaryAccuracy()`,
also inside a MetricCollection or ModuleDict), logged or computed by hand, so a run resumed
mid-epoch ends the epoch with the same values; a Metric logged in an epoch that the module does
not hold makes the first save fail, naming it. Lightning keeps none of these states. On the same
number of processes each process gets its own states back; on another number, process 0 gets them
merged (sums added, lists joined, extremes taken) and the others start empty.
torchmetrics is never imported here: a value is a Metric only if torchmetrics is loaded already.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from fittrain.common.reprs import short_repr
from fittrain.distributed import collectives

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer

#: Where CallbackStates keeps the states (callbacks' keys start with a digit: never the same).
STATE_KEY = "torchmetrics:states"


def as_metric(value: Any) -> Any | None:
    """`value` when it is a torchmetrics `Metric`, else None."""
    torchmetrics = sys.modules.get("torchmetrics")
    return value if torchmetrics is not None and isinstance(value, torchmetrics.Metric) else None


def metric_value(name: str, metric: Any, value: Any, when: str) -> torch.Tensor:
    """A metric's value (its forward's or compute's) as a detached 0-d tensor.

    Raises:
        ValueError: for anything but a one-element tensor.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(())
    raise ValueError(f"self.log({name!r}, {type(metric).__name__}): the metric's {when} returned {short_repr(value)}; "
                     "self.log takes a metric whose value is one number. Log the values of such a metric one by one, "
                     "as numbers: the items of metric.compute() at the epoch's end.")


def computed(name: str, metric: Any) -> float:
    """`metric.compute()` as a float (a collective in torchmetrics when several processes run)."""
    return float(metric_value(name, metric, metric.compute(), "compute()"))


class MetricObjects:
    """The Metric objects `self.log` received in the current training epoch, for the epoch value and
    the reset after the epoch, and the module's Metric states that checkpoints keep. `MetricLog` owns
    one per fit.

    Args:
        trainer: The Trainer, whose module and accelerator it reads.
    """

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.epoch: dict[str, Any] = {}  # epoch value name -> metric (on_epoch=True)
        self.used: dict[int, Any] = {}  # id -> every metric logged in this training epoch (reset at its end)
        self.ending: dict[int, Any] = {}  # id -> the metrics to reset after on_train_epoch_end
        self._hook: Any = None  # the save pre-hook's handle: from setup if the module holds a Metric
        self._gathered: dict[str, Any] | None = None  # what the last save's pre-hook collected

    # ----------------------------------------------------------------- logging
    def log_step(self, name: str, metric: Any, step_names: tuple[str, ...], epoch_name: str | None) -> None:
        """A metric logged in a training batch: its step value now, its epoch value at the epoch's end."""
        if self._hook is None:  # a Metric the module does not hold: the first save says so
            self._hook = self.trainer.accelerator.register_save_state_pre_hook(self._collect)
        self.used[id(metric)] = metric
        if epoch_name is not None:
            if self.epoch.setdefault(epoch_name, metric) is not metric:
                raise ValueError(f"self.log({name!r}, ...) received another Metric object than earlier in this epoch "
                                 "under that name. Log each metric under a name of its own.")
        cache = metric._forward_cache
        if cache is not None and step_names:  # None: only update() ran, which gives no value of this batch
            value = metric_value(name, metric, cache, "forward")
            metrics = self.trainer.state.raw_metrics
            for step_name in step_names:
                metrics[step_name] = value

    def end_epoch(self) -> dict[str, float]:
        """The epoch values, computed in the order of their names (every process alike: torchmetrics
        syncs in compute). The epoch's metrics are reset by `reset`, after on_train_epoch_end; a
        checkpoint saved meanwhile keeps none of their states (the next epoch starts empty)."""
        epoch, self.epoch = self.epoch, {}
        self.ending.update(self.used)
        self.used = {}
        return {name: computed(name, metric) for name, metric in sorted(epoch.items())}

    def compute_now(self, name: str, metric: Any, reset_with_epoch: bool) -> float:
        """A metric logged in an epoch hook: its value now; with `reset_with_epoch` it is reset with the
        training epoch's metrics (an evaluation loop resets its own)."""
        if reset_with_epoch:
            self.ending[id(metric)] = metric
        return computed(name, metric)

    def reset(self) -> None:
        """Resets the metrics of the training epoch that ended (after on_train_epoch_end)."""
        ending, self.ending = self.ending, {}
        for metric in ending.values():
            metric.reset()

    def close(self) -> None:
        """Removes the save pre-hook (at the fit's end)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ----------------------------------------------------------------- checkpoints
    def start(self) -> None:
        """Watches saves when the module holds a Metric (at the fit's setup; a Metric logged later that
        the module does not hold makes the first save fail, naming it)."""
        if self._hook is None and module_metrics(self.trainer.module):
            self._hook = self.trainer.accelerator.register_save_state_pre_hook(self._collect)

    def _collect(self, *hook_args: Any) -> None:
        """The save pre-hook, on every process: the states of the module's Metrics that something updated
        since their last reset (not those of an epoch that just ended: they are about to be reset), copied
        to the CPU and gathered; the main process writes them with the callbacks' states."""
        held = module_metrics(self.trainer.module)
        paths = {id(metric): path for path, metric in held.items()}
        for key, metric in self.used.items():
            if key not in paths:
                kind = type(metric).__name__
                raise ValueError(f"A checkpoint cannot keep the state of the {kind} logged with self.log in this "
                                 f"epoch: it is not an attribute of the module. Assign it in __init__ (self.acc = "
                                 f"{kind}(...)), or put it in a torch.nn.ModuleDict or ModuleList there.")
        mine = {path: {"states": {attr: _to_cpu(getattr(metric, attr)) for attr in metric._defaults},
                       "updates": int(metric._update_count)}
                for path, metric in held.items() if metric._update_count and id(metric) not in self.ending}
        self._gathered = {
            "processes": self.trainer.accelerator.num_processes,
            # The epoch values each metric gives, and the metrics the epoch logged (reset at its end): a
            # resumed epoch computes and resets them even with no batch left to log them.
            "epoch": {name: paths[id(metric)] for name, metric in self.epoch.items()},
            "used": sorted(paths[key] for key in self.used),
            "ranks": collectives.gather_object(mine, self.trainer.accelerator.state)}

    def state_dict(self) -> dict[str, Any] | None:
        """What the last save's pre-hook gathered; None when the fit saved no Metric's state."""
        return self._gathered

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resets the module's Metrics and gives each process its saved states back (merged on process 0
        for another process count).

        Raises:
            ValueError: when the module has no Metric where the checkpoint has states, or a state
                cannot be merged across processes (a reduction other than sum, cat, min, max).
        """
        held = module_metrics(self.trainer.module)
        for metric in held.values():
            metric.reset()
        if not state:
            return
        acc, ranks = self.trainer.accelerator, state["ranks"]
        same = state["processes"] == acc.num_processes
        for path in sorted({path for entries in ranks for path in entries} | set(state["used"])):
            if path not in held:
                raise ValueError(f"The checkpoint holds the states of a torchmetrics Metric at {path!r} of the "
                                 f"module, but {type(self.trainer.module).__name__} has no Metric there. Resume "
                                 "with the module that saved it.")
        entries = [ranks[acc.process_index]] if same else ranks if acc.process_index == 0 else []
        for path, metric in held.items():
            saved = [entry[path] for entry in entries if path in entry]
            if saved:
                _restore(path, metric, saved)
        self.used = {id(held[path]): held[path] for path in state["used"]}
        self.epoch = {name: held[path] for name, path in state["epoch"].items()}


def module_metrics(module: torch.nn.Module) -> dict[str, Any]:
    """The torchmetrics Metrics a module holds, by attribute path (a MetricCollection's members too)."""
    return {path: sub for path, sub in module.named_modules() if as_metric(sub) is not None}


@contextlib.contextmanager
def states_kept(module: torch.nn.Module) -> Iterator[None]:
    """Runs the block, then gives the module's Metrics back the states they had before it: for a batch
    that only keeps this process in step with the others (FSDP2's repeated evaluation batch), so that
    an update in it counts nowhere."""
    kept = [(metric, {attr: _copied(getattr(metric, attr)) for attr in metric._defaults}, metric._update_count,
             metric._computed) for metric in module_metrics(module).values()]
    try:
        yield
    finally:
        for metric, states, updates, computed in kept:
            for attr, value in states.items():
                setattr(metric, attr, value)
            metric._update_count, metric._computed = updates, computed


def _copied(state: Any) -> Any:
    # update() adds into tensor states in place and appends to list states: both need a copy.
    return list(state) if isinstance(state, list) else state.clone()


def _to_cpu(state: Any) -> Any:
    if isinstance(state, list):
        return [t.detach().to("cpu", copy=True) for t in state]
    return state.detach().to("cpu", copy=True)


def _restore(path: str, metric: Any, entries: list[dict[str, Any]]) -> None:
    """Sets the metric's states from one process's entry, or several merged by each state's reduction."""
    for attr, default in metric._defaults.items():
        saved = [entry["states"][attr] for entry in entries]
        if len(saved) == 1:
            value = saved[0]
        else:
            value = merge_state(path, attr, metric._reductions.get(attr), saved)
        # The metric's device: its states follow the module's .to() (a list state's default is empty).
        setattr(metric, attr, [t.to(metric.device) for t in value] if isinstance(default, list)
                else value.to(metric.device))
    metric._update_count = sum(entry["updates"] for entry in entries)


def merge_state(path: str, attr: str, reduction: Callable[..., Any] | None, saved: list[Any]) -> Any:
    """Several processes' values of one state, merged as torchmetrics would reduce them across processes."""
    name = getattr(reduction, "__name__", repr(reduction))
    if isinstance(saved[0], list):
        if name == "dim_zero_cat":
            return [t for value in saved for t in value]
    elif name == "dim_zero_sum":
        return torch.stack(saved).sum(dim=0)
    elif name == "dim_zero_cat":
        return torch.cat(saved)
    elif name in ("dim_zero_max", "dim_zero_min"):
        return torch.stack(saved).amax(dim=0) if name == "dim_zero_max" else torch.stack(saved).amin(dim=0)
    raise ValueError(f"The checkpoint holds the states of the Metric at {path!r} from {len(saved)} processes; this "
                     f"run has another number of processes, and its state {attr!r} (reduced with {name}) cannot be "
                     f"merged. Resume on {len(saved)} processes, or from a checkpoint saved at an epoch's end.")
