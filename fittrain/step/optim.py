"""The prepared optimizer and scheduler: thin wrappers that respect gradient accumulation.

`AcceleratedOptimizer.step()` and `zero_grad()` do nothing on batches inside an accumulation
window, and the fp16 scaler decides whether a real step happens. `AcceleratedScheduler.step()`
advances only after a real optimizer step. Everything else is forwarded to the wrapped objects,
so `param_groups`, `state_dict()` and `get_last_lr()` behave as users know them.
"""

from __future__ import annotations

from typing import Any

import torch

from fittrain.distributed.gradient_state import GradientState
from fittrain.step.precision import FullPrecision


class AcceleratedOptimizer(torch.optim.Optimizer):
    """An optimizer that steps only at the end of an accumulation window.

    It subclasses `torch.optim.Optimizer` so LR schedulers accept it, but keeps no state of its
    own: `param_groups`, `state` and `defaults` are the wrapped optimizer's.

    Args:
        optimizer: The optimizer to wrap.
        gradient_state: The owning Accelerator's accumulation state.
        precision: The owning Accelerator's precision object (for loss scaling).
    """

    # Deliberately skips Optimizer.__init__: every attribute is forwarded to `optimizer`.
    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 precision: FullPrecision) -> None:
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.precision = precision
        self._step_was_skipped = False
        precision.track(optimizer)  # an fp16 scaler updates differently for several optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients, except inside an accumulation window where they must add up."""
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Steps at the end of an accumulation window; records whether fp16 skipped the step."""
        if not self.gradient_state.sync_gradients:
            return
        skipped = not self.precision.step(self.optimizer, closure)
        self._step_was_skipped = self.gradient_state.step_was_skipped = skipped

    @property
    def step_was_skipped(self) -> bool:
        """Whether this optimizer's last real step was skipped because fp16 gradients overflowed."""
        return self._step_was_skipped

    def train(self) -> None:
        """Calls the wrapped optimizer's `train()`, for those that have one (schedule-free ones:
        they switch the parameters between their training and evaluation points); else nothing."""
        self._forward_mode("train")

    def eval(self) -> None:
        """Calls the wrapped optimizer's `eval()` where it has one; else nothing (as `train`)."""
        self._forward_mode("eval")

    def _forward_mode(self, name: str) -> None:
        # Optimizer has no train()/eval(), and __getattr__ is not forwarded, so look on the wrapped one.
        method = getattr(self.optimizer, name, None)
        if callable(method):
            method()


class AcceleratedScheduler:
    """An LR scheduler that advances only when the optimizer really stepped.

    As in Accelerate, with `split_batches=False` one optimizer step on N processes consumes N
    per-process batches, so the schedule advances N times per step; set `steps_per_call=1` to
    count optimizer steps instead (the Trainer does).

    Args:
        scheduler: The scheduler to wrap.
        gradient_state: The owning Accelerator's accumulation state.
        step_with_optimizer: When False, every `step()` call advances the schedule.
        steps_per_call: How many times the wrapped scheduler advances per real step.
    """

    def __init__(self, scheduler: Any, gradient_state: GradientState, step_with_optimizer: bool = True,
                 steps_per_call: int = 1) -> None:
        self.scheduler = scheduler
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_call = steps_per_call
        # The prepared optimizer this scheduler drives, when known (the Trainer's manual
        # optimization links it): its own skipped step counts, not the last step of any optimizer.
        self.stepping_optimizer: AcceleratedOptimizer | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advances the schedule after a real optimizer step; a no-op otherwise."""
        if self.step_with_optimizer:
            linked = self.stepping_optimizer
            skipped = self.gradient_state.step_was_skipped if linked is None else linked.step_was_skipped
            if not self.gradient_state.sync_gradients:
                if self.gradient_state.adjust_scheduler:
                    # As Accelerate: the scheduler's call count follows the batches (torch warns on
                    # a count that lags the optimizer's); the schedule itself waits for a real step.
                    self.scheduler._step_count = getattr(self.scheduler, "_step_count", 0) + 1
                return
            if skipped:
                return
            for _ in range(self.steps_per_call):
                self.scheduler.step(*args, **kwargs)
            return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here: forward them to the real scheduler.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"AcceleratedScheduler({self.scheduler!r})"
