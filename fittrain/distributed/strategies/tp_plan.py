"""A model's tensor-parallel plan: which layers are split between the tp ranks, and how.

The plan is a `tp_plan` attribute, transformers' convention (`LlamaConfig.base_model_tp_plan`,
`PreTrainedModel.tp_plan`): a dict from module names, where `*` stands for one name part (a layer
index), to a style. A style is one of transformers' names below, or one of torch's own
`ParallelStyle` objects (`ColwiseParallel(...)`, `RowwiseParallel(...)`, `SequenceParallel()`,
`PrepareModuleInput(...)`, ...) for anything else. A submodule's own `tp_plan` counts too, under its
name (a TrainModule holding a transformers model needs no plan of its own).

Example:
    >>> class GPT(nn.Module):
    ...     tp_plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise",
    ...                "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}

Attention must then find its head count from the split projection (`view(B, T, -1, head_dim)`), as
transformers' models do: each tp rank holds `heads / tp_size` of them.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any, Callable

from torch import nn

from fittrain.common.reprs import short_repr


def _styles() -> dict[str, Callable[[], Any]]:
    # torch.distributed.tensor.parallel is imported only by a run that parallelizes: it is not small.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": ColwiseParallel,  # output features split; the output stays split (local)
        "rowwise": RowwiseParallel,  # input features split; outputs summed into a whole tensor
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),  # split, output gathered whole
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),  # takes a whole input
        "sequence_parallel": SequenceParallel,  # norms and dropout on a sequence-split activation
    }


def plan_of(model: nn.Module) -> dict[str, Any]:
    """The model's plan: its `tp_plan` and its submodules', each under the submodule's name.

    Raises:
        ValueError: when no module has a plan, or a plan is not a dict.
    """
    plan: dict[str, Any] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "tp_plan", None)
        if own is None:
            continue
        if not isinstance(own, dict):
            raise ValueError(f"{type(module).__name__}.tp_plan must be a dict of module names to styles, as "
                             f"transformers' models have. Received: {short_repr(own)} ({type(own).__name__}). "
                             "Write e.g. tp_plan = {'layers.*.q_proj': 'colwise', 'layers.*.o_proj': 'rowwise'}.")
        plan.update((f"{prefix}.{key}" if prefix else key, style) for key, style in own.items())
    if not plan:
        raise ValueError(
            f"ParallelismConfig(tp_size>1) splits layers as the model's `tp_plan` says, but {type(model).__name__} "
            "(and every module in it) has none. Received: a model without a tp_plan attribute. Give it one, e.g. "
            "model.tp_plan = {'layers.*.q_proj': 'colwise', 'layers.*.o_proj': 'rowwise'} (names as in "
            "named_modules(), '*' for a layer index), or use tp_size=1.")
    return plan


def _matches(pattern: str, name: str) -> bool:
    parts, atoms = pattern.split("."), name.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(atom, part) for atom, part in zip(atoms, parts))


def split_dim(module: nn.Module, style: Any) -> dict[str, int]:
    """Parameter name -> the dimension `style` splits it along, as torch's styles do: colwise splits
    a Linear's rows (weight and bias) and an Embedding's columns, rowwise a Linear's weight columns
    (its bias stays whole) and an Embedding's rows. Empty for other styles and modules."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # see _styles

    embedding = isinstance(module, nn.Embedding)
    if not (embedding or isinstance(module, nn.Linear)):
        return {}
    if isinstance(style, ColwiseParallel):
        dims = {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    elif isinstance(style, RowwiseParallel):
        dims = {"weight": 0} if embedding else {"weight": 1}
    else:
        return {}
    return {key: dim for key, dim in dims.items() if getattr(module, key, None) is not None}


def _check_divisible(model: nn.Module, name: str, pattern: str, style: Any, tp_size: int) -> None:
    module = model.get_submodule(name)
    for key, dim in split_dim(module, style).items():
        size = getattr(module, key).shape[dim]
        if size % tp_size:
            raise ValueError(
                f"tp_plan[{pattern!r}] splits {name}.{key} ({type(module).__name__}, {size} along dimension {dim}) "
                f"between tp_size={tp_size} ranks, and {size} does not divide by {tp_size}: attention heads and "
                f"features would be cut apart. Received: tp_size={tp_size}. Use a tp_size that divides {size}.")


def resolve_plan(model: nn.Module, tp_size: int = 1) -> dict[str, Any]:
    """The plan of `model` as `parallelize_module` takes it: concrete module names to torch styles.

    Every pattern must name at least one module, and every style be known, so a typo is an error
    rather than a layer silently left whole on every rank; a Linear or Embedding must split evenly
    into `tp_size` parts.

    Raises:
        ValueError: for a pattern that matches no module, an unknown style, or an uneven split.
    """
    from torch.distributed.tensor.parallel import ParallelStyle  # see _styles

    styles, names = _styles(), [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Any] = {}
    for pattern, style in plan_of(model).items():
        if isinstance(style, str) and style in styles:
            style = styles[style]()
        elif not isinstance(style, ParallelStyle):
            raise ValueError(
                f"tp_plan[{pattern!r}] must be one of {sorted(styles)} or a torch ParallelStyle object "
                f"(torch.distributed.tensor.parallel). Received: {short_repr(style)}. Use one of those names, "
                "or pass torch's style object for other layouts.")
        matched = [name for name in names if _matches(pattern, name)]
        if not matched:
            near = difflib.get_close_matches(pattern, names, n=1)
            hint = f" The nearest module name is {near[0]!r}." if near else ""
            raise ValueError(
                f"tp_plan's pattern {pattern!r} names no module of {type(model).__name__}.{hint} Received: that "
                "pattern. Use names as model.named_modules() gives them, with '*' for one part (a layer index).")
        for name in matched:
            _check_divisible(model, name, pattern, style, tp_size)
            resolved[name] = style
    return resolved
