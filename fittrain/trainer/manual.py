"""Manual optimization: `training_step` steps its optimizers itself, with Lightning's names.

A module sets `self.automatic_optimization = False` in `__init__`; its `training_step` then calls
`self.optimizers()`, `self.manual_backward(loss)`, `opt.step()`, `opt.zero_grad()` and, if it
likes, `self.lr_schedulers()` and `sch.step()`. The Trainer's loop for one batch is then:

    with accelerator.accumulate(model), accelerator.autocast():
        training_step(batch)            # any number of forwards, manual_backward and steps
            manual_backward(loss)       # on_before_backward, accelerator.backward, on_after_backward
            opt.step()                  # on a batch that ends an accumulation window only:
                                        #   gradients averaged over processes (DDP), then
                                        #   on_before_optimizer_step (trainer.optimizer is opt), step
    global_step += 1                    # once per batch that ends an accumulation window

What differs from Lightning, and why:
- The optimizers are the Accelerator's prepared ones, so `opt.step()` and `opt.zero_grad()` do
  nothing inside an accumulation window: gradient accumulation needs no code in training_step.
- `global_step` counts training steps (accumulation windows), not `opt.step()` calls, so with
  two optimizers `max_steps`, `Checkpointer(every_n_steps)` and `val_every_n_steps` keep their
  meaning (Lightning counts each optimizer's step).
- The loop steps no scheduler: training_step calls `sch.step()`. A prepared scheduler does not
  advance after a step its optimizer skipped (fp16 overflow) or inside an accumulation window.
- Under DDP, training_step runs on the module itself, not through DDP's forward: DDP's reducer
  expects one backward per forward, and a GAN runs several of each per batch. Gradients are
  local until a real `opt.step()`, which first averages that optimizer's gradients over the
  processes (one all-reduce per optimizer step). This is right for any number of forwards and
  backwards. Buffers (BatchNorm statistics) are then not broadcast from process 0 at each forward.
- Under FSDP2 training_step runs through the root's forward, as in automatic mode; every
  backward reduce-scatters the gradients of the sharded submodules it reached. Every parameter
  must sit in a sharded submodule (the root's own would be resharded by the first backward).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from fittrain.common.checks import check_choice, check_positive_number
from fittrain.step.optim import AcceleratedOptimizer, AcceleratedScheduler
from fittrain.trainer.events import Event
from fittrain.trainer.parts import StepRunner, extract_loss
from fittrain.trainer.schedules import Schedule

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


class ManualOptimizer(AcceleratedOptimizer):
    """What `self.optimizers()` returns: a prepared optimizer whose real steps fire the Trainer's
    `on_before_optimizer_step` (and, under DDP, average the gradients first).

    Everything else (`param_groups`, `state`, `zero_grad`, `state_dict`) is the prepared
    optimizer's, which is the one checkpoints hold.
    """

    def __init__(self, prepared: AcceleratedOptimizer, loop: "ManualOptimization") -> None:
        super().__init__(prepared.optimizer, prepared.gradient_state, prepared.precision)
        self.prepared = prepared
        self._loop = loop
        self.step_called = False  # in the current batch; reset by the loop before each batch

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Steps at the end of an accumulation window (a no-op inside one), firing the events."""
        self.step_called = True
        if self.gradient_state.sync_gradients:
            self._loop.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, except where they must add up over an accumulation window.

        Called before this batch's `step()`, it clears on the first batch of a window (the
        previous window's leftovers); called after it, it clears once the window's real step is
        done. Both orders users write then accumulate correctly: `zero_grad(); backward; step()`
        (Lightning's GAN loops) and `backward; step(); zero_grad()` (Accelerate's loops).
        """
        called = self.step_called
        if (called and self.gradient_state.sync_gradients) or (not called and self._loop.window_start):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def step_was_skipped(self) -> bool:
        """Whether this optimizer's last real step was skipped because fp16 gradients overflowed."""
        return self.prepared.step_was_skipped

    def __repr__(self) -> str:
        return f"ManualOptimizer({self.optimizer!r})"


class ManualOptimization:
    """Manual optimization (`automatic_optimization = False`): the Trainer's `train_batch` and the step
    machinery behind `self.optimizers()` and `self.manual_backward(loss)`.

    Args:
        trainer: The Trainer fitting `module`.
        model: The prepared model.
        module: The TrainModule.
        optimizers: The prepared optimizers, in the order configure_optimizers returned them.
        schedulers: The LR schedulers returned (not yet prepared), in order.

    Attributes:
        model, optimizers, schedulers: What the Trainer publishes as trainer.model, .optimizers, .schedulers.
        schedule: The loop steps no scheduler here: training_step does (`sch.step()`).
    """

    is_manual = True

    def __init__(self, trainer: "Trainer", model: nn.Module, module: nn.Module,
                 optimizers: list[AcceleratedOptimizer], schedulers: list[Any]) -> None:
        self.trainer, self.accelerator, self.model = trainer, trainer.accelerator, model
        self.optimizers = [ManualOptimizer(o, self) for o in optimizers]
        self.schedulers = [self._prepare_scheduler(s) for s in schedulers]
        self.schedule = Schedule()
        strategy = self.accelerator.distributed_strategy
        module_itself = strategy.unwrap(model)
        outside = strategy.root_unit_parameters(module_itself)
        if outside:
            _refuse_root_parameters(module_itself, outside)
        # DDP's forward is bypassed (see the module docstring); FSDP2's root forward is kept.
        self._run = StepRunner(module_itself, module, strategy)
        averaging = strategy.needs_manual_gradient_averaging(model)
        self._average: Callable[[list[nn.Parameter]], None] = self._average_gradients if averaging else _no_op
        # Each optimizer's parameters, in the module's order, found once (GradClip reads them too).
        self.parameters = {id(o): optimizer_parameters(o, module_itself) for o in self.optimizers}
        # Whether the current batch starts an accumulation window (a checkpoint is only ever saved at
        # the end of one, so a fit or resume starts with a window).
        self.window_start = True
        # The batch's training_step output and the loss of the last manual_backward, for the module's
        # hooks (on_train_batch_end(outputs, ...), on_before_backward(loss)).
        self.outputs: Any = None
        self.loss: Any = None

    def _prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        prepared = self.accelerator.prepare(scheduler)
        prepared.steps_per_call = 1  # the Trainer counts optimizer steps, not per-process batches
        prepared.stepping_optimizer = next(o for o in self.optimizers if o.optimizer is scheduler.optimizer)
        return prepared

    # ----------------------------------------------------------------- one batch
    def train_batch(self, batch: Any) -> bool:
        """Runs training_step on one batch; True when the batch ended an accumulation window."""
        trainer, acc = self.trainer, self.accelerator
        for optimizer in self.optimizers:
            optimizer.step_called = False
        with acc.accumulate(self.model):
            try:
                with acc.autocast():
                    self.outputs = output = self._run("training_step", batch, trainer.state.batch_idx)
            finally:
                self.window_start = acc.sync_gradients  # the next batch starts a window after this one ends it
            loss = extract_loss(output.get("loss") if isinstance(output, dict) else output)
            if loss is not None:
                trainer.state.loss = loss.detach()
                trainer.state.raw_metrics["train_loss"] = trainer.state.loss
            if not acc.sync_gradients:
                return False
        trainer.state.global_step += 1
        return True

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`manual_backward`: the events around `accelerator.backward` (scaling, accumulation)."""
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ValueError(
                "manual_backward(loss) needs a tensor computed from the module's parameters (requires_grad=True). "
                f"Received: {type(loss).__name__}" + (" with requires_grad=False" if isinstance(loss, torch.Tensor)
                                                       else "") + ". Pass the loss itself, not loss.item() or a "
                "detached copy, and compute it outside torch.no_grad().")
        fire = self.trainer.events.fire
        self.loss = loss
        fire(Event.BEFORE_BACKWARD, self.trainer)
        # training_step runs under autocast; backward should not (PyTorch's AMP rule).
        device_type = self.accelerator.device.type
        off = torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else _NO_CONTEXT
        with off:
            self.accelerator.backward(loss, **kwargs)
        fire(Event.AFTER_BACKWARD, self.trainer)

    def step(self, optimizer: ManualOptimizer, closure: Any) -> None:
        """One real step of `optimizer`: average its gradients (DDP), fire the event, step."""
        trainer = self.trainer
        params = self.parameters[id(optimizer)]
        trainer.optimizer = optimizer
        try:
            if closure is None:
                self._average(params)
                trainer.events.fire(Event.BEFORE_OPTIMIZER_STEP, trainer)
            else:
                closure = self._wrap_closure(closure, params)
            optimizer.prepared.step(closure)
        finally:
            trainer.optimizer = self.optimizers[0]

    def _wrap_closure(self, closure: Callable[[], Any], params: list[nn.Parameter]) -> Callable[[], Any]:
        """A closure (LBFGS) computes the gradients inside the step: average them after each call, and
        fire on_before_optimizer_step after the first, when there are gradients to act on."""
        fired = []

        def wrapped() -> Any:
            with torch.enable_grad():
                loss = closure()
            self._average(params)
            if not fired:
                fired.append(True)
                self.trainer.events.fire(Event.BEFORE_OPTIMIZER_STEP, self.trainer)
            return loss

        return wrapped

    def _average_gradients(self, params: list[nn.Parameter]) -> None:
        """Averages the gradients of `params` over the processes: one all-reduce per dtype.

        A parameter without a gradient on some process counts as zero there; one without a
        gradient on every process keeps None, as DDP leaves it, so the optimizer skips it.
        """
        by_kind: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault((p.device, p.dtype), []).append(p)
        world = self.accelerator.num_processes
        for (device, dtype), group in by_kind.items():
            present = torch.tensor([p.grad is not None for p in group], dtype=dtype, device=device)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group]
                             + [present])
            total = self.accelerator.reduce(flat, reduction="sum")
            offset = 0
            for p, seen in zip(group, total[-len(group):].tolist()):
                size = p.numel()
                if seen:
                    grad = total[offset:offset + size].view_as(p).div_(world)
                    if p.grad is None:
                        p.grad = grad.clone()
                    else:
                        p.grad.copy_(grad)
                offset += size


def optimizer_parameters(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[nn.Parameter]:
    """The parameters `optimizer` steps, in `module.parameters()` order (so a clip norm sums as
    it would over the module's parameters); ones the module does not hold come last."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    ordered = [p for p in module.parameters() if id(p) in held]
    known = {id(p) for p in ordered}
    return ordered + [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]


def clip_gradients(trainer: "Trainer", optimizer: Any, value: float | None, algorithm: str) -> None:
    """`TrainModule.clip_gradients`: clips `optimizer`'s gradients (unscaled first under fp16).

    Raises:
        ValueError: for an unknown `algorithm` or a value that is not a positive number.
    """
    check_choice("gradient_clip_algorithm", algorithm, ("norm", "value"), owner="clip_gradients")
    if check_positive_number("gradient_clip_val", value, owner="clip_gradients", optional=True) is None:
        return
    acc = trainer.accelerator
    if acc.sync_gradients:
        acc.unscale_gradients(optimizer)  # only this optimizer: another's gradients may still grow
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if algorithm == "norm":
        acc.distributed_strategy.clip_grad_norm_(params, float(value))
    else:
        acc.distributed_strategy.clip_grad_value_(params, float(value))


def _refuse_root_parameters(model: nn.Module, outside: list[str]) -> None:
    """Under FSDP2, manual optimization needs every parameter in a sharded submodule."""
    raise ValueError(
        f"Manual optimization under strategy='fsdp' needs every parameter inside a sharded submodule, but "
        f"{type(model).__name__} holds {len(outside)} in its root unit (e.g. {outside[0]!r}): the first "
        "manual_backward would reshard them while training_step still uses them. Move them into a submodule "
        "(e.g. an nn.Linear or your own nn.Module), or leave fsdp_classes unset so every module holding "
        "parameters is sharded, or use strategy='ddp'.")


def _no_op(params: list[nn.Parameter]) -> None:
    """Nothing to average: one process, or FSDP2, whose backward already reduced the gradients."""


_NO_CONTEXT = contextlib.nullcontext()
