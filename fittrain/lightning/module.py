"""`LightningModule` and `LightningDataModule`: fittrain's `TrainModule` and `DataModule` with the few
things a Lightning program reads or overrides that the native classes do not have.

What the subclass adds, and why it is not in `TrainModule` itself:

- `configure_optimizers`: a scheduler returned without an `"interval"` steps every **epoch**
  (Lightning's default); the native Trainer's default is every optimizer step. The subclass's
  method is wrapped once, when the class is defined, so the rest of the loop is the native one.
- `self.log` also tells the Lightning Trainer which names were logged where, so that
  `trainer.callback_metrics`, `logged_metrics` and `progress_bar_metrics` hold what Lightning's
  do (fittrain/lightning/metrics.py) and the loggers get Lightning's rows.
- `setup(stage)`, `teardown(stage)`, `prepare_data()` and the `*_dataloader()` methods, which the
  Lightning Trainer calls where Lightning does (fittrain/lightning/stages.py).
- `logger`, `loggers`, `global_rank`, `local_rank`, `example_input_array`, `all_gather`, `dtype`,
  `on_gpu`, `freeze`/`unfreeze`, `to_torchscript`/`to_onnx`, `strict_loading` (read by
  `load_from_checkpoint`).

Lightning hooks with no fittrain counterpart (`optimizer_step`, `backward`, `on_before_zero_grad`,
`transfer_batch_to_device`, ...) are refused when a fit starts, naming the fittrain way
(`check_lightning_module`): a program that overrides one would otherwise silently run without it.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from fittrain.data import batch_size_of
from fittrain.trainer.configure import SchedulerConfig
from fittrain.trainer.datamodule import DataModule
from fittrain.trainer.hparams import HPARAMS, HPARAMS_INITIAL, save_hyperparameters
from fittrain.trainer.metric_objects import as_metric
from fittrain.trainer.module import TrainModule

if TYPE_CHECKING:
    from fittrain.lightning.loggers.base import Logger

#: Lightning methods a program may override that fittrain never calls -> what to do instead.
UNSUPPORTED_HOOKS = {
    "optimizer_step": "the Trainer steps the optimizer; use a callback's on_before_optimizer_step, or manual "
                      "optimization (self.automatic_optimization = False) to step it yourself",
    "optimizer_zero_grad": "the Trainer zeroes the gradients after each step; use manual optimization to do it "
                           "yourself",
    "backward": "the Trainer calls backward; use on_before_backward/on_after_backward, or manual optimization",
    "lr_scheduler_step": "return {'scheduler': s, 'interval': ..., 'frequency': ...} from configure_optimizers, or "
                         "step it yourself in manual optimization",
    "configure_gradient_clipping": "pass Trainer(gradient_clip_val=...) or call self.clip_gradients in manual "
                                   "optimization",
    "on_before_zero_grad": "use on_before_optimizer_step (gradients are zeroed right after the step)",
    "transfer_batch_to_device": "batches are moved to the device by the prepared DataLoader; move other objects "
                                "in training_step",
    "on_before_batch_transfer": "transform the batch in the DataLoader's collate_fn or in training_step",
    "on_after_batch_transfer": "transform the batch in training_step",
    "configure_model": "build the layers in __init__ or setup(stage)",
    "configure_sharded_model": "build the layers in __init__ or setup(stage)",
    "on_validation_model_eval": "the Trainer puts the module in eval mode for validation",
    "on_validation_model_train": "the Trainer puts the module back in train mode after validation",
    "on_validation_model_zero_grad": "the Trainer zeroes gradients itself",
    "on_test_model_eval": "the Trainer puts the module in eval mode for testing",
    "on_test_model_train": "the Trainer restores the module's mode after testing",
    "on_predict_model_eval": "the Trainer puts the module in eval mode for predicting",
}


class LightningModule(TrainModule):
    """`TrainModule` under Lightning's name, for drop-in ports (`import fittrain.lightning as pl`).

    Everything of `TrainModule` holds (steps with or without `batch_idx`, `self.log` with
    Lightning's options, `save_hyperparameters`, module hooks, manual optimization); the
    differences to the native class are listed in this module's docstring.

    """

    #: Lightning's: whether `load_from_checkpoint(strict=None)` requires every key to match.
    strict_loading: bool = True
    # What torch.jit.script must not compile (Lightning's list): the Trainer-facing properties.
    __jit_unused_properties__ = ["example_input_array", "on_gpu", "current_epoch", "global_step", "global_rank",
                                 "local_rank", "logger", "loggers", "automatic_optimization", "trainer",
                                 "strict_loading", "device", "dtype", "hparams", "hparams_initial"]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("configure_optimizers")
        if own is not None and not getattr(own, "_lightning_intervals", False):
            cls.configure_optimizers = _with_epoch_intervals(own)

    # ----------------------------------------------------------------- Lightning's data hooks
    def prepare_data(self) -> None:
        """Once per node, before `setup`: download or write files."""

    def setup(self, stage: str) -> None:
        """On every process, before the stage ("fit", "validate", "test", "predict") runs, after the
        datamodule's `setup` and the callbacks'."""

    def teardown(self, stage: str) -> None:
        """On every process, after the stage ran."""

    # ----------------------------------------------------------------- logging
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None, metric_attribute: str | None = None,
            rank_zero_only: bool = False) -> None:
        """`TrainModule.log` (Lightning's options and defaults), noting the name for the Lightning
        Trainer's metric views and loggers (fittrain/lightning/metrics.py)."""
        trainer = self.__dict__.get("_trainer")
        names = getattr(trainer, "logged_names", None)
        if names is None:  # no Lightning Trainer runs the module: the native log (which refuses without one)
            super().log(name, value, prog_bar=prog_bar, logger=True if logger is None else logger, on_step=on_step,
                        on_epoch=on_epoch, reduce_fx=reduce_fx, enable_graph=enable_graph, sync_dist=sync_dist,
                        sync_dist_group=sync_dist_group, add_dataloader_idx=add_dataloader_idx,
                        batch_size=batch_size, metric_attribute=metric_attribute, rank_zero_only=rank_zero_only)
            return
        logger = True if logger is None else logger
        if trainer.barebones:
            raise ValueError(f"{type(self).__name__}.log({name!r}, ...): logging is off in "
                             "Trainer(barebones=True), as in Lightning. Remove barebones=True to log.")
        # The names a call records are noted for Lightning's views, once per row (LoggedNames.note); in a
        # training batch, at every step, the "noted already" lookup is made here, without a call.
        evaluation = trainer.evaluation
        if evaluation.averager is None:
            if trainer.batch is None or evaluation.running or (
                    (name, "step", prog_bar, logger, on_step, on_epoch) not in names.seen):
                names.note(trainer, name, prog_bar, logger, on_step, on_epoch)
        else:
            names.note(trainer, name, prog_bar, logger, on_step, on_epoch)
            # A torchmetrics Metric, computed by torchmetrics over every process; asked only in evaluation,
            # so a training step's self.log pays nothing for it.
            metric = as_metric(value)
            if metric is not None and on_step:
                raise ValueError(f"{type(self).__name__}.log({name!r}, {type(metric).__name__}, on_step=True) in an "
                                 "evaluation loop: fittrain logs a Metric's compute() at the loop's end only. Leave "
                                 "on_step out, or log the metric's value of the batch, metric(preds, target).")
            if not sync_dist and on_epoch is not False and metric is None:
                names.add_local(name, value, float(batch_size or batch_size_of(evaluation.batch) or 1))
            if on_step:
                # Lightning's per-batch value in an evaluation loop (x_step, for the loggers), which the
                # native loop does not record; its mean over the loop is the native `x`.
                names.record_eval_step(name, value, on_epoch)
                if on_epoch is False:
                    return
                on_step = None
        # What TrainModule.log does with a running Trainer, called here directly: this runs at every
        # self.log of every training step, and a second frame with Lightning's 14 keyword arguments
        # cost about a microsecond a call (benchmarks/overhead.py, "fittrain.lightning ... self.log x3").
        if enable_graph or sync_dist_group is not None or metric_attribute is not None or rank_zero_only:
            self._check_log_options(name, value, enable_graph, sync_dist_group, metric_attribute, rank_zero_only)
        trainer.logged.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size)

    # ----------------------------------------------------------------- Lightning's attributes
    @property
    def logger(self) -> "Logger | None":
        """The Trainer's first logger (Lightning's `self.logger`), or None."""
        trainer = self.__dict__.get("_trainer")
        return getattr(trainer, "logger", None)

    @property
    def loggers(self) -> "list[Logger]":
        """The Trainer's loggers (Lightning's `self.loggers`); [] without a Trainer."""
        trainer = self.__dict__.get("_trainer")
        return list(getattr(trainer, "loggers", []))

    @property
    def global_step(self) -> int:
        """Lightning's: optimizer steps taken, each optimizer's counted in manual optimization."""
        return self.trainer.global_step

    @property
    def global_rank(self) -> int:
        """This process's index among all processes (0 without a Trainer)."""
        trainer = self.__dict__.get("_trainer")
        return trainer.accelerator.process_index if trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's index on its machine (0 without a Trainer)."""
        trainer = self.__dict__.get("_trainer")
        return trainer.accelerator.local_process_index if trainer is not None else 0

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (Lightning's `self.dtype`): the first one's,
        torch's default dtype when it has none."""
        first = next((p for p in self.parameters() if p.is_floating_point()), None)
        return first.dtype if first is not None else torch.get_default_dtype()

    @property
    def example_input_array(self) -> Any:
        """An input for `ModelSummary`'s in/out sizes and for `to_torchscript`/`to_onnx` (None until set)."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, value: Any) -> None:  # a property, as Lightning's: TorchScript skips it
        self.__dict__["_example_input_array"] = value

    def configure_callbacks(self) -> Any:
        """Lightning's: callbacks this module needs, called as each stage starts. Each replaces the Trainer's
        callbacks of its class (or a base class of it); ModelCheckpoints run last. None or [] adds nothing."""
        return []

    @property
    def on_gpu(self) -> bool:
        """Lightning's: whether the module runs on a CUDA device."""
        return self.device.type == "cuda"

    @torch.no_grad()
    def to_torchscript(self, file_path: Any = None, method: str = "script", example_inputs: Any = None,
                       **kwargs: Any) -> Any:
        """Lightning's: the module compiled by `torch.jit.script` (or traced, `method="trace"`, on
        `example_inputs` or `example_input_array`) in eval mode, saved to `file_path` when given; the
        module's mode is restored after.

        Raises:
            ValueError: for another method, or tracing without example inputs.
        """
        if method not in ("script", "trace"):
            raise ValueError(f"{type(self).__name__}.to_torchscript(method=...) takes 'script' or 'trace'. Received: "
                             f"method={method!r}.")
        inputs = self.example_input_array if example_inputs is None else example_inputs
        if method == "trace" and inputs is None:
            raise ValueError(f"{type(self).__name__}.to_torchscript(method='trace') needs inputs to trace: pass "
                             "example_inputs=..., or set self.example_input_array.")
        mode = self.training
        self.__dict__["_jit_is_scripting"] = True  # `trainer` reads as None, as in Lightning, while torch looks
        try:
            compiled = torch.jit.script(self.eval(), **kwargs) if method == "script" \
                else torch.jit.trace(self.eval(), example_inputs=inputs, **kwargs)
        finally:
            del self.__dict__["_jit_is_scripting"]
            self.train(mode)
        if file_path is not None:
            torch.jit.save(compiled, os.fspath(file_path))
        return compiled

    @torch.no_grad()
    def to_onnx(self, file_path: Any, input_sample: Any = None, **kwargs: Any) -> None:
        """Lightning's: `torch.onnx.export` of the module in eval mode on `input_sample` (or
        `example_input_array`); the module's mode is restored after. torch's exporter needs the
        `onnx` package (and its default one `onnxscript`), which fittrain does not install.

        Raises:
            ValueError: without an input sample.
        """
        sample = self.example_input_array if input_sample is None else input_sample
        if sample is None:
            raise ValueError(f"{type(self).__name__}.to_onnx() needs an input to export with: pass input_sample=..., "
                             "or set self.example_input_array.")
        mode = self.training
        try:
            torch.onnx.export(self.eval(), sample if isinstance(sample, tuple) else (sample,), file_path, **kwargs)
        finally:
            self.train(mode)

    def freeze(self) -> None:
        """Lightning's: no parameter requires a gradient, and the module is in eval mode."""
        for parameter in self.parameters():
            parameter.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Lightning's: every parameter requires a gradient, and the module is in train mode."""
        for parameter in self.parameters():
            parameter.requires_grad = True
        self.train()

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
        """Lightning's: the module rebuilt from a checkpoint folder's hyperparameters and weights
        (`_load_from_checkpoint`; `weights_only` changes nothing: nothing is ever unpickled)."""
        return _load_from_checkpoint(cls, checkpoint_path, map_location, hparams_file, strict, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Lightning's: each tensor from every process, stacked along a new first dimension (the tensor
        itself on one process).

        Raises:
            ValueError: for `group` or `sync_grads=True`, which fittrain does not support.
        """
        if group is not None or sync_grads:
            raise ValueError(f"{type(self).__name__}.all_gather(group=..., sync_grads=True) is not supported by "
                             "fittrain.lightning: it gathers over every process, without gradients. Received: "
                             f"group={group!r}, sync_grads={sync_grads}.")
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return data
        from fittrain.common.nested import map_tensors  # only where a program gathers: keeps the import lazy

        return map_tensors(lambda t: accelerator.gather(t.unsqueeze(0)), data)


def _load_from_checkpoint(cls: type, checkpoint_path: Any, map_location: Any, hparams_file: Any, strict: bool | None,
                          **kwargs: Any) -> Any:
    """Lightning's `Module.load_from_checkpoint(path, **kwargs)` for a fittrain checkpoint folder: the
    module built from the hyperparameters the checkpoint kept (`save_hyperparameters`), `kwargs`
    winning, then its weights loaded from `model.safetensors`; on `map_location` if given, else the CPU.

    Hyperparameters that are not numbers, strings, lists or dicts are kept as their repr only: pass them
    again as keyword arguments (as Lightning programs do for an `ignore`d backbone).

    Raises:
        ValueError: for `hparams_file`, which fittrain.lightning does not read.
        CheckpointError, FileNotFoundError: for a folder that is no complete fittrain checkpoint.
    """
    # Loading a checkpoint is rare: these imports stay off `import fittrain`.
    from fittrain.checkpoint.model_io import load_model_weights
    from fittrain.checkpoint.reader import CheckpointReader

    if hparams_file is not None:
        raise ValueError(f"{cls.__name__}.load_from_checkpoint(hparams_file=...) is not supported by "
                         "fittrain.lightning: the checkpoint keeps the hyperparameters; pass any others as keyword "
                         "arguments.")
    key, saved = f"hparams:{cls.__name__}", {}
    with CheckpointReader(checkpoint_path) as reader:
        for name in reader.names():
            if name.startswith("custom_checkpoint_") and name.endswith(".pt"):
                state = reader.read_torch(name)
                if isinstance(state, dict) and isinstance(state.get(key), dict):
                    saved = dict(state[key])
    signature = inspect.signature(cls.__init__)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    chosen = {k: v for k, v in saved.items() if takes_any or k in signature.parameters}
    module = cls(**{**chosen, **kwargs})
    strict = module.strict_loading if strict is None else strict  # Lightning's default: the module's attribute
    module.load_state_dict(load_model_weights(checkpoint_path), strict=strict)
    return module.to(map_location) if isinstance(map_location, (str, torch.device)) else module


def check_lightning_module(module: Any) -> None:
    """Refuses a module overriding a Lightning hook that fittrain never calls (`UNSUPPORTED_HOOKS`).

    Raises:
        NotImplementedError: naming the method and the fittrain way.
    """
    for name, instead in UNSUPPORTED_HOOKS.items():
        if name in _defined_names(type(module)):
            raise NotImplementedError(
                f"{type(module).__name__}.{name} is a Lightning hook that fittrain.lightning does not call, so it "
                f"would silently never run. Instead: {instead}.")


def _defined_names(cls: type) -> set[str]:
    """The names the classes between `cls` and LightningModule define (the user's own methods)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (LightningModule, TrainModule) or klass is torch.nn.Module:
            break
        names.update(klass.__dict__)
    return names


def _with_epoch_intervals(configure: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps `configure_optimizers` so that a scheduler without an "interval" steps every epoch."""

    @functools.wraps(configure)
    def configure_optimizers(self: LightningModule) -> Any:
        result = configure(self)
        if self.automatic_optimization:  # in manual optimization the loop steps no scheduler: nothing to default
            result = epoch_intervals(result)
        # What LearningRateMonitor names and when it logs (Lightning's trainer.lr_scheduler_configs).
        object.__setattr__(self, "lr_scheduler_configs", scheduler_configs(result))
        return result

    configure_optimizers._lightning_intervals = True  # type: ignore[attr-defined]
    return configure_optimizers


def epoch_intervals(result: Any) -> Any:
    """What `configure_optimizers` returned, with Lightning's default interval ("epoch") written
    into every scheduler that names none; forms the native parser refuses are left for it to refuse."""
    if isinstance(result, dict):
        return _dict_with_interval(result)
    if not isinstance(result, (list, tuple)):
        return result
    if len(result) == 1 and isinstance(result[0], dict):
        return [_dict_with_interval(result[0])]
    if len(result) != 2:
        return result
    optimizers, schedulers = (_as_list(item) for item in result)
    if len(optimizers) != 1 or len(schedulers) != 1 or isinstance(optimizers[0], (dict, list, tuple)):
        return result
    return {"optimizer": optimizers[0], "lr_scheduler": _scheduler_with_interval(schedulers[0])}


def scheduler_configs(result: Any) -> list[SchedulerConfig]:
    """The schedulers in what `configure_optimizers` returned, in order, with their "name" and
    "interval" (Lightning's default "epoch"); other keys keep the native defaults."""
    configs: list[SchedulerConfig] = []

    def add(spec: Any) -> None:
        if isinstance(spec, dict):
            if spec.get("scheduler") is not None:
                configs.append(SchedulerConfig(spec["scheduler"], spec.get("interval", "epoch"), name=spec.get("name")))
        elif spec is not None and hasattr(spec, "optimizer"):
            configs.append(SchedulerConfig(spec, "epoch"))

    items = [result] if isinstance(result, dict) else list(result) if isinstance(result, (list, tuple)) else []
    if len(items) == 2 and all(isinstance(item, (list, tuple)) for item in items):
        items = list(items[1])  # ([optimizers], [schedulers])
    for item in items:
        if isinstance(item, dict) and "optimizer" in item:
            add(item.get("lr_scheduler"))
        else:
            for spec in item if isinstance(item, (list, tuple)) else [item]:
                add(spec)
    return configs


def _as_list(item: Any) -> list[Any]:
    return list(item) if isinstance(item, (list, tuple)) else [item]


def _dict_with_interval(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("lr_scheduler") is None:
        return spec
    return {**spec, "lr_scheduler": _scheduler_with_interval(spec["lr_scheduler"])}


def _scheduler_with_interval(scheduler: Any) -> Any:
    if isinstance(scheduler, dict):
        return scheduler if "interval" in scheduler else {**scheduler, "interval": "epoch"}
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return {"scheduler": scheduler, "interval": "epoch"}
    return scheduler  # ReduceLROnPlateau (not an LRScheduler before torch 2.2) and others: the native defaults


class LightningDataModule(DataModule):
    """`fittrain.DataModule` under Lightning's name, with Lightning's `trainer` attribute and
    `save_hyperparameters`/`hparams`.

    Attributes:
        trainer: The Lightning Trainer running this datamodule's stage (None before).
    """

    trainer: Any = None

    hparams = HPARAMS
    hparams_initial = HPARAMS_INITIAL

    def save_hyperparameters(self, *names: str, ignore: Sequence[str] | str = ()) -> None:
        """Records the calling `__init__`'s arguments in `self.hparams`, as the module's does."""
        save_hyperparameters(self, inspect.currentframe().f_back, names, ignore)
