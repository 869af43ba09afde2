"""GradClip: bound the gradients, by total norm or element by element, before each optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from fittrain.common.checks import check_positive_number
from fittrain.trainer.events import Callback
from fittrain.trainer.manual import optimizer_parameters

if TYPE_CHECKING:
    from fittrain.trainer.trainer import Trainer


def _check_limit(name: str, value: Any, optional: bool = True) -> float | None:
    checked = check_positive_number(name, value, owner="GradClip", optional=optional, wanted="a positive number")
    return None if checked is None else float(checked)


class GradClip(Callback):
    """Clips gradients before each optimizer step, by total norm or element-wise by value.

    It acts in `on_before_optimizer_step`, which runs on sync steps only, so it sees the whole
    accumulated gradient. It clips the gradients of the optimizer about to step
    (`trainer.optimizer`): in manual optimization with several optimizers, each step clips only
    its own parameters. fp16 gradients are unscaled first (that optimizer's only), so the limits
    are in the units of the true gradients. The total gradient norm before clipping is recorded as the metric
    `grad_norm` (kept as a tensor, so recording it costs no device sync).

    Args:
        max_norm: Scales all gradients together so that their total norm is at most this.
        max_value: Clamps every gradient element to `[-max_value, max_value]`.
        norm_type: The p of the p-norm (`float("inf")` for the largest element), used both for
            `max_norm` and for the recorded `grad_norm`.

    Raises:
        ValueError: unless exactly one of `max_norm` and `max_value` is given, as a positive
            number, and `norm_type` is a positive number.

    Example:
        >>> Trainer(callbacks=[GradClip(max_norm=1.0)]).fit(module, loader)
    """

    def __init__(self, max_norm: float | None = None, max_value: float | None = None, norm_type: float = 2.0) -> None:
        if (max_norm is None) == (max_value is None):
            raise ValueError("`GradClip` needs exactly one of `max_norm` (clip the total norm) and `max_value` "
                             f"(clip each element). Received: max_norm={max_norm!r}, max_value={max_value!r}.")
        self.max_norm = _check_limit("max_norm", max_norm)
        self.max_value = _check_limit("max_value", max_value)
        self.norm_type = _check_limit("norm_type", norm_type, optional=False)
        # The mode is chosen once here, so the step itself never asks which one is on.
        self._clip: Callable[["Trainer"], torch.Tensor] = (
            self._clip_norm if self.max_norm is not None else self._clip_value)
        self._parameters: dict[int, list[torch.nn.Parameter]] = {}  # per optimizer, found at its first step

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Forgets the parameter lists of a previous fit's optimizers."""
        self._parameters = {}

    def on_before_optimizer_step(self, trainer: "Trainer") -> None:
        """Clips the accumulated gradients and records their pre-clip total norm as `grad_norm`."""
        trainer.record("grad_norm", self._clip(trainer))

    def _stepping_parameters(self, trainer: "Trainer") -> list[torch.nn.Parameter]:
        """The parameters of the optimizer about to step, in the module's order, after unscaling them.

        Only that optimizer is unscaled: with several (manual optimization), unscaling another
        now would leave the gradients its next backward adds scaled when it steps.
        """
        optimizer = trainer.optimizer
        params = self._parameters.get(id(optimizer))
        if params is None:
            params = self._parameters[id(optimizer)] = optimizer_parameters(optimizer, trainer.model)
        trainer.accelerator.unscale_gradients(optimizer)
        return params

    def _clip_norm(self, trainer: "Trainer") -> torch.Tensor:
        params = self._stepping_parameters(trainer)
        # The strategy returns the full norm (under FSDP2, over every rank's shards).
        return trainer.accelerator.distributed_strategy.clip_grad_norm_(params, self.max_norm, self.norm_type)

    def _clip_value(self, trainer: "Trainer") -> torch.Tensor:
        params = [p for p in self._stepping_parameters(trainer) if p.grad is not None]
        strategy = trainer.accelerator.distributed_strategy
        norm = strategy.grad_norm(params, self.norm_type)
        strategy.clip_grad_value_(params, self.max_value)
        return norm

    def __repr__(self) -> str:
        limit = f"max_norm={self.max_norm}" if self.max_norm is not None else f"max_value={self.max_value}"
        return f"GradClip({limit}, norm_type={self.norm_type})"

