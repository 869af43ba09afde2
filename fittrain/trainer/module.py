"""TrainModule: the nn.Module users subclass to describe one training step.

Example:
    >>> class Regressor(TrainModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.net = nn.Linear(8, 1)
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch):
    ...         x, y = batch
    ...         return nn.functional.mse_loss(self(x), y)
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from fittrain.common.reprs import short_repr
from fittrain.trainer.hparams import HPARAMS, HPARAMS_INITIAL, recordable, save_hyperparameters
from fittrain.trainer.manual import clip_gradients
from fittrain.trainer.metric_objects import as_metric, module_metrics
from fittrain.trainer.module_hooks import LifecycleHooks

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


class TrainModule(LifecycleHooks, nn.Module):
    """An nn.Module that knows how to train itself: a step, an optional validation step, and
    its optimizer; optionally, a test step and a prediction step.

    It takes part in the loop like a callback: override any of Lightning's hooks it inherits
    (`on_train_epoch_end`, `on_validation_epoch_end`, `on_train_batch_end(outputs, batch,
    batch_idx)`, `on_save_checkpoint(checkpoint)`, ...; fittrain/trainer/module_hooks.py). A
    method named `on_*` that is no hook is refused when fit starts, as for callbacks.

    While fitting, `self.trainer`, `self.device`, `self.global_step` and `self.current_epoch`
    tell where training stands, and `self.log(name, value)` records a metric.

    Attributes:
        automatic_optimization: True (the default): the Trainer runs backward and steps the one
            optimizer. Set `self.automatic_optimization = False` in `__init__` for manual
            optimization (Lightning's name): training_step then steps any number of optimizers
            itself with `self.optimizers()`, `self.manual_backward(loss)` and `opt.step()`; see
            `fittrain.trainer.manual`.
    """

    automatic_optimization: bool = True

    def training_step(self, batch: Any) -> torch.Tensor | dict[str, Any] | None:
        """Computes the loss of one batch.

        Define it as `training_step(self, batch)` or, as in Lightning, `training_step(self, batch,
        batch_idx)`: the Trainer reads the signature once and passes the batch's index within its
        epoch when there is room for it. The same holds for the validation, test and predict steps.

        Returns:
            A scalar loss tensor, a dict with a "loss" key, or None to skip the batch (no
            backward, no optimizer step).
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement training_step(self, batch) returning a scalar loss tensor, "
            "a dict with a 'loss' key, or None to skip the batch."
        )

    def validation_step(self, batch: Any) -> torch.Tensor | dict[str, Any] | None:
        """Optional. Returns a scalar (recorded as `val_loss`) or a dict of named scalars.

        Each value is averaged over the whole validation set and over all processes.
        """
        raise NotImplementedError(
            f"{type(self).__name__} was given a validation loader but does not implement "
            "validation_step(self, batch). Implement it, or pass no val_loader."
        )

    def test_step(self, batch: Any) -> torch.Tensor | dict[str, Any] | None:
        """Optional. Like `validation_step`, for `Trainer.test`; without it, `Trainer.test` runs
        `validation_step` (which is what this default calls).

        Returns:
            A scalar (recorded as `test_loss`) or a dict of named scalars, each averaged over the
            whole test set and all processes. Names are given the prefix `test_`: `val_acc` and
            `acc` are both recorded as `test_acc`, and `test_acc` stays as it is.
        """
        return self.validation_step(batch)

    def predict_step(self, batch: Any) -> Any:
        """Optional. The output of one batch for `Trainer.predict`; by default `self(batch)`, the
        module's forward on the whole batch (override it for batches such as `(x, y)`).

        Returns:
            A tensor, or a dict, tuple or list of tensors, whose first dimension is the batch's
            samples; or a list with one item (of any picklable kind) per sample.
        """
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Returns an optimizer, an (optimizer, scheduler) pair, or a dict with the keys
        "optimizer" and "lr_scheduler".

        One optimizer, over this module's parameters (several parts: one parameter group each),
        and at most one LR scheduler built on it. Lightning's lists of one (`[opt], [sched]`) work
        too. "lr_scheduler" may be Lightning's dict, `{"scheduler": s, "interval": "step" or
        "epoch", "frequency": n, "monitor": "val_loss"}`; ReduceLROnPlateau steps on its monitor
        after validation (`fittrain.trainer.schedules` says when each kind steps). Anything else is
        refused when `fit` starts.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement configure_optimizers(self) returning an optimizer, "
            "an (optimizer, scheduler) pair, or {'optimizer': ..., 'lr_scheduler': ...}."
        )

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: Any = "mean", enable_graph: bool = False,
            sync_dist: bool = False, sync_dist_group: Any = None, add_dataloader_idx: bool = True,
            batch_size: int | None = None, metric_attribute: str | None = None, rank_zero_only: bool = False) -> None:
        """Records a metric, with Lightning's options and defaults (fittrain/trainer/logged.py).

        In a training batch it is a step value (`on_step=True`); with `on_epoch=True` also reduced
        over the epoch (`reduce_fx`, weighted by `batch_size`, by default the batch's). In
        validation_step and test_step it is averaged over every sample of the loop. `sync_dist`
        reduces across processes, `prog_bar` shows it on the progress bar, `logger=False` keeps it
        from the trackers; `add_dataloader_idx` changes nothing (a loop has one loader), nor does
        `metric_attribute` (fittrain finds a Metric's attribute itself; when given, it must name the
        logged Metric among the module's submodules, as in Lightning). Tensors are
        kept on their device and read only when something asks; one that may change in place later
        (a parameter, a buffer, a view of one) is copied, so the value logged is the value now. A
        torchmetrics `Metric` (an attribute of the module) is logged as Lightning logs it
        (fittrain/trainer/metric_objects.py).

        Raises:
            RuntimeError: outside a running Trainer.
            ValueError: for an option fittrain does not support (`enable_graph`, `sync_dist_group`,
                `rank_zero_only`, each named with the fittrain way), a `metric_attribute` that does not
                name the logged Metric, or an option the place of the call cannot honour.
        """
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__}.log({name!r}, ...) needs a running Trainer: call it "
                               "from training_step, validation_step or test_step while the Trainer runs the module "
                               "(fit, validate, test or predict).")
        if enable_graph or sync_dist_group is not None or metric_attribute is not None or rank_zero_only:
            self._check_log_options(name, value, enable_graph, sync_dist_group, metric_attribute, rank_zero_only)
        trainer.logged.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size)

    def _check_log_options(self, name: str, value: Any, enable_graph: bool, sync_dist_group: Any,
                           metric_attribute: Any, rank_zero_only: bool) -> None:
        """Refuses the options of Lightning's `self.log` that fittrain does not support, naming the fittrain
        way, and a `metric_attribute` that does not name the logged Metric (off the per-step path: only
        a call that passes one of them gets here)."""
        if enable_graph:
            option, fix = "enable_graph=True", "logged values are detached; log loss.detach()"
        elif sync_dist_group is not None:
            option, fix = "sync_dist_group", "sync_dist reduces over every process"
        elif rank_zero_only:
            option, fix = "rank_zero_only=True", "call self.log on every process"
        else:
            self._check_metric_attribute(name, value, metric_attribute)
            return
        raise ValueError(f"{type(self).__name__}.log({name!r}, ..., {option}...): fittrain does not support this "
                         f"option of Lightning's; {fix}.")

    def _check_metric_attribute(self, name: str, value: Any, metric_attribute: Any) -> None:
        """Lightning's `metric_attribute`: the name of the submodule holding a logged Metric (Lightning
        restores its state through it). fittrain finds that attribute itself, so the option changes
        nothing; like Lightning, it has no meaning for a value that is not a Metric."""
        if as_metric(value) is None:
            return
        try:
            found = self.get_submodule(metric_attribute) if isinstance(metric_attribute, str) else None
        except AttributeError:
            found = None
        if found is not value:
            held = module_metrics(self)
            where = (f"the submodule path that holds it (the module's Metrics: {', '.join(map(repr, held))})" if held
                     else "the attribute you assign it to in __init__ (the module holds no Metric now)")
            raise ValueError(
                f"{type(self).__name__}.log({name!r}, {type(value).__name__}, metric_attribute={metric_attribute!r}): "
                f"the logged Metric is not there. Pass {where}, or leave metric_attribute out: fittrain finds it.")

    def log_dict(self, dictionary: dict[str, Any], **options: Any) -> None:
        """`self.log(name, value, **options)` for each item (Lightning's `log_dict`); with `sync_dist`,
        the values of a batch are reduced across processes together, in one collective."""
        for name, value in dictionary.items():
            self.log(name, value, **options)

    hparams = HPARAMS
    hparams_initial = HPARAMS_INITIAL

    def save_hyperparameters(self, *names: str, ignore: Sequence[str] | str = ()) -> None:
        """Records the arguments of the `__init__` that calls it in `self.hparams` (Lightning's name):
        all of them, or only `names`, minus `ignore`. Trackers record them when a run starts, and
        every checkpoint keeps them (`recordable_hparams`); a resume with other values warns. Before
        it, `self.hparams` is an empty dict that is recorded nowhere (fittrain/trainer/hparams.py).

        Raises:
            RuntimeError: when not called from an `__init__`.
            ValueError: for a name in `names` or `ignore` that `__init__` has no argument of.
        """
        save_hyperparameters(self, inspect.currentframe().f_back, names, ignore)

    def recordable_hparams(self) -> dict[str, Any] | None:
        """The saved `hparams` as checkpoints and trackers keep them (`fittrain.trainer.hparams.recordable`)."""
        return recordable(self)

    # ----------------------------------------------------------------- manual optimization
    def optimizers(self) -> Any:
        """The prepared optimizer, or a list of them when configure_optimizers returned several.

        Their `step()` and `zero_grad()` do nothing inside a gradient-accumulation window, so
        training_step needs no code for accumulation.
        """
        optimizers = self._fitting_trainer("optimizers()").optimizers
        return optimizers[0] if len(optimizers) == 1 else list(optimizers)

    def lr_schedulers(self) -> Any:
        """The prepared LR scheduler, a list of them when several were returned, or None.

        In manual optimization the Trainer steps none of them: call `sch.step()` in
        training_step. A prepared scheduler does not advance inside an accumulation window or
        after a step its optimizer skipped (fp16 overflow).
        """
        schedulers = self._fitting_trainer("lr_schedulers()").schedulers
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else list(schedulers)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Lightning's: until `untoggle_optimizer`, only `optimizer`'s parameters require gradients, so
        a backward leaves the other optimizers' parameters (a GAN's discriminator) without any.

        Parameters that required no gradient before keep requiring none.

        Raises:
            RuntimeError: outside a running fit.
            ValueError: for an optimizer that is not one of `self.optimizers()`.
        """
        trainer = self._fitting_trainer("toggle_optimizer(optimizer)")
        if not any(optimizer is opt for opt in trainer.optimizers):
            raise ValueError(f"{type(self).__name__}.toggle_optimizer() takes one of self.optimizers(). Received: "
                             f"{short_repr(optimizer)}. Pass the optimizer self.optimizers() returned.")
        before: dict[torch.Tensor, bool] = self.__dict__.get("_requires_grad_before") or {}
        for opt in trainer.optimizers:
            for param in _parameters_of(opt):
                before.setdefault(param, param.requires_grad)
                param.requires_grad_(False)
        for param in _parameters_of(optimizer):
            param.requires_grad_(before[param])
        object.__setattr__(self, "_requires_grad_before", before)  # not a module attribute: never saved

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Gives every parameter the `requires_grad` it had before `toggle_optimizer(optimizer)`."""
        before = self.__dict__.get("_requires_grad_before") or {}
        for param, required in before.items():
            param.requires_grad_(required)
        object.__setattr__(self, "_requires_grad_before", {})

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """`toggle_optimizer(optimizer)` for the block, then `untoggle_optimizer` (also when it raises)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only (Lightning's `self.print`); anywhere `print` on each process."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None or trainer.accelerator.is_main_process:
            print(*args, **kwargs)

    def manual_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Use instead of `loss.backward()` in manual optimization: it scales the loss for fp16,
        divides it over the accumulation window, and fires `on_before_backward`/`on_after_backward`."""
        self._manual_loop("manual_backward(loss)").backward(loss, **kwargs)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str = "norm") -> None:
        """Clips `optimizer`'s gradients (unscaled first under fp16), by total norm or by value.

        Call it between `manual_backward` and `optimizer.step()` (or use the GradClip callback,
        which clips the stepping optimizer's gradients in both modes).
        """
        clip_gradients(self._fitting_trainer("clip_gradients(...)"), optimizer, gradient_clip_val,
                       gradient_clip_algorithm)

    def _fitting_trainer(self, method: str) -> "Trainer":
        trainer = self.__dict__.get("_trainer")
        if trainer is None or not trainer.optimizers:
            raise RuntimeError(f"{type(self).__name__}.{method} needs a running Trainer.fit, which prepares the "
                               "optimizers: call it from training_step while fit runs, not from __init__ or "
                               "configure_optimizers or before fit.")
        return trainer

    def _manual_loop(self, method: str) -> Any:
        trainer = self._fitting_trainer(method)
        if not trainer.optimization.is_manual:
            raise RuntimeError(
                f"{type(self).__name__}.{method} is for manual optimization, and this module uses automatic "
                "optimization (automatic_optimization=True), where the Trainer calls backward on the loss "
                "training_step returns. Set self.automatic_optimization = False in __init__ to call backward and "
                "step the optimizers yourself, or return the loss and let the Trainer do it.")
        return trainer.optimization

    def has_validation_step(self) -> bool:
        """Whether the subclass implements `validation_step`."""
        return type(self).validation_step is not TrainModule.validation_step

    def has_test_step(self) -> bool:
        """Whether the subclass implements `test_step`."""
        return type(self).test_step is not TrainModule.test_step

    def can_predict(self) -> bool:
        """Whether `predict_step` can run: the subclass implements it, or a forward for its default."""
        return type(self).predict_step is not TrainModule.predict_step or type(self).forward is not nn.Module.forward

    # Stored outside nn.Module's registries so the Trainer is neither a submodule nor saved.
    def attach(self, trainer: "Trainer | None") -> None:
        """Links this module to the Trainer fitting it (None unlinks)."""
        object.__setattr__(self, "_trainer", trainer)

    @property
    def trainer(self) -> "Trainer":
        """The Trainer fitting this module."""
        trainer = self.__dict__.get("_trainer")
        if trainer is None and not self.__dict__.get("_jit_is_scripting"):  # torch.jit.script reads every attribute
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer; call Trainer.fit first.")
        return trainer

    @property
    def device(self) -> torch.device:
        """The device the module's parameters live on."""
        trainer = self.__dict__.get("_trainer")
        if trainer is not None:
            return trainer.accelerator.device
        first = next(self.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.trainer.state.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch being trained, from 0."""
        return self.trainer.state.epoch


def _parameters_of(optimizer: Any) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]
