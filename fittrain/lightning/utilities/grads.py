"""Lightning's `grad_norm`: the norm of each parameter's gradient and of all of them, to log."""

from __future__ import annotations

import torch
from torch import nn


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The `norm_type`-norm of each parameter's gradient, and of all gradients as one vector.

    The names are Lightning's, `grad_{p}_norm{group_separator}{parameter}` and `grad_{p}_norm_total`
    (p as a float: "grad_2.0_norm/net.weight"), so `self.log_dict(grad_norm(self, 2))` in
    `on_before_optimizer_step` logs what it logs in Lightning. Parameters without a gradient are
    left out; the dict is empty when none has one.

    Raises:
        ValueError: when `norm_type` is not a positive number or "inf".
    """
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = float("nan")
    if not p > 0:
        raise ValueError(f"grad_norm(norm_type=...) must be a positive number or 'inf' (the largest absolute value). "
                         f"Received: norm_type={norm_type!r}. Pass 2 for the Euclidean norm.")
    norms = {f"grad_{p}_norm{group_separator}{name}": param.grad.detach().norm(p)
             for name, param in module.named_parameters() if param.grad is not None}
    if norms:
        # The norm of the per-parameter norms is the norm of all gradients concatenated.
        norms[f"grad_{p}_norm_total"] = torch.stack(list(norms.values())).norm(p)
    return norms
