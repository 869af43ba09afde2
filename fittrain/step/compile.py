"""torch.compile for prepared models: option checks, and compiling a module's forward in place.

`Accelerator(dynamo_backend="inductor")` (Accelerate's name) and `Trainer(compile=True or a dict
of torch.compile options)` compile the prepared model. Unlike `torch.compile(model)`, which
returns an `OptimizedModule` whose state_dict keys start with `_orig_mod.`, fittrain compiles the
module's forward *in place*: `module.forward = torch.compile(module.forward, **options)`. The
module stays the user's object, so its parameter names, state_dict, checkpoints, `save_model`
and `unwrap_model` are those of the plain model: a checkpoint loads into a compiled or a plain
model alike.

Why the forward and not `nn.Module.compile()` (which compiles `_call_impl`): the Trainer runs a
step under DDP or FSDP2 by pointing the wrapped module's forward at `training_step` for one call
(`fittrain.trainer.parts.make_step_runner`). A compiled `_call_impl` would trace that swap, a new function
each step, and recompile every step; a compiled forward is called by the user's `self(x)` inside
the step and sees the same code every time. The precision wrapper (`AutocastForward`) goes
outside the compiled forward, so autocast is set before the compiled code runs and the outputs
are cast to float32 after it. Under FSDP2 the innermost sharded units are compiled instead of
the root (the strategy's `compile_targets`).

`torch._dynamo` costs about a second to import, so this module imports it only when a model is
compiled or a backend name is checked (`torch._inductor`, when an inductor mode is checked): `import
fittrain`, and prepare without compile, never pay it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from fittrain.common.reprs import short_repr
from fittrain.step.precision import AutocastForward

#: The keyword options of `torch.compile` that `Trainer(compile={...})` accepts.
COMPILE_OPTIONS = ("backend", "mode", "fullgraph", "dynamic", "options", "disable")


def _known_backends() -> list[str]:
    import torch._dynamo  # lazily: see the module docstring

    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def check_backend_name(name: str, argument: str) -> str:
    """Returns `name` when torch.compile knows a backend of that name.

    Raises:
        ValueError: naming `argument`, the value and the backends this torch has.
    """
    known = _known_backends()
    if name not in known:
        raise ValueError(f"`{argument}` names a torch.compile backend that this torch does not have. Received: "
                         f"{argument}={name!r}. Known backends: {', '.join(known)}. Use 'inductor' (the default) to "
                         "generate fused code, 'eager' or 'aot_eager' to check that the model traces.")
    return name


def check_dynamo_backend(value: Any) -> dict[str, Any] | None:
    """Checks `Accelerator(dynamo_backend=...)`; returns the torch.compile options, None for no compile.

    None and "no" (any case) mean no compile. Accelerate's upper-case names ("INDUCTOR",
    "AOT_EAGER", or its `DynamoBackend` enum, a str) are accepted and lowered.

    Raises:
        TypeError: for something other than a str or None.
        ValueError: for a backend name torch.compile does not know.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"`dynamo_backend` must be a backend name such as 'inductor', or None (no compile). Received: "
                        f"dynamo_backend={short_repr(value)} ({type(value).__name__}). For torch.compile options "
                        "such as "
                        "mode or a backend function, use Trainer(compile={...}) or accelerator.compile_options.")
    name = str(getattr(value, "value", value)).lower()
    if name == "no":
        return None
    return {"backend": check_backend_name(name, "dynamo_backend")}


def compile_settings(backend: Any, plugin: Any) -> dict[str, Any] | None:
    """The torch.compile options of `Accelerator(dynamo_backend=..., dynamo_plugin=...)`.

    Args:
        backend: The `dynamo_backend` argument.
        plugin: A `TorchDynamoPlugin` (its type checked by the Accelerator's configuration:
            anything with `to_kwargs()`), or None.

    Raises:
        ValueError: for both given, or what `check_dynamo_backend` / `check_compile` refuse.
    """
    if plugin is None:
        return check_dynamo_backend(backend)
    if backend is not None and str(getattr(backend, "value", backend)).lower() != "no":
        raise ValueError(f"Pass either `dynamo_backend` or `dynamo_plugin`, not both. Received: dynamo_backend="
                         f"{short_repr(backend)} and dynamo_plugin={short_repr(plugin)}. Set the backend in the "
                         "plugin.")
    return check_compile(plugin.to_kwargs(), "dynamo_plugin")


def check_compile(value: Any, argument: str = "compile") -> dict[str, Any] | None:
    """Checks `Trainer(compile=...)`: False or None mean no compile, True torch.compile's defaults,
    and a dict holds torch.compile's keyword options.

    Returns:
        The options (a new dict; {} for the defaults), or None for no compile.

    Raises:
        TypeError: for a value that is not a bool, a dict or None.
        ValueError: for a key torch.compile does not take, a backend name it does not know, an
            inductor mode it does not know, or both a mode and options.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"`{argument}` must be True, False or a dict of torch.compile options. Received: {argument}="
                        f"{short_repr(value)} ({type(value).__name__}). "
                        f"Example: {argument}={{'mode': 'max-autotune'}}.")
    unknown = [key for key in value if key not in COMPILE_OPTIONS]
    if unknown:
        raise ValueError(f"`{argument}` holds a key torch.compile does not take: {unknown[0]!r}. Received: {argument}="
                         f"{short_repr(value)}. Accepted keys: {', '.join(COMPILE_OPTIONS)}.")
    if isinstance(value.get("backend"), str):
        check_backend_name(value["backend"], f"{argument}['backend']")
    _check_mode(value, argument)
    return dict(value)


def _check_mode(value: dict[str, Any], argument: str) -> None:
    """Refuses what torch.compile would refuse at the first step: an unknown inductor mode, or a mode
    together with inductor options. Another backend receives the mode itself and may define its own."""
    mode = value.get("mode")
    if mode is not None and value.get("options") is not None:
        raise ValueError(f"`{argument}` holds both 'mode' and 'options', which torch.compile does not take together. "
                         f"Received: {argument}={short_repr(value)}. Pass one: a mode, or inductor's options.")
    if mode is None or value.get("backend", "inductor") != "inductor":
        return
    from torch._inductor import list_mode_options  # lazily: see the module docstring

    modes = list(list_mode_options())
    if mode not in modes:
        raise ValueError(f"`{argument}['mode']` is not a mode of torch.compile's inductor. Received: "
                         f"{argument}['mode']={short_repr(mode)}. Valid modes: {', '.join(map(repr, modes))}. "
                         "'max-autotune' compiles "
                         "longest for the fastest code; leave the mode out for 'default'.")


def same_options(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two option dicts compile alike (a missing backend is torch.compile's 'inductor')."""
    return {"backend": "inductor", **first} == {"backend": "inductor", **second}


class CompiledForward:
    """A module's forward compiled with torch.compile, installed on the instance as `forward`.

    `original` is the forward that was compiled (the bound class forward). Copies recompile for
    the copy: `copy.deepcopy(model)` (an EMA or teacher model) must not run the original model's
    forward, which a plain function in the instance's `__dict__` would, since deepcopy shares it.
    """

    def __init__(self, original: Callable[..., Any], options: dict[str, Any]) -> None:
        self.original = original
        self.options = options
        self.compiled = torch.compile(original, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "CompiledForward":
        # deepcopy binds the copied method to the module's copy (the memo holds it).
        return CompiledForward(copy.deepcopy(self.original, memo), dict(self.options))

    def __reduce__(self) -> tuple[Any, ...]:
        return CompiledForward, (self.original, self.options)


def is_compiled_forward(forward: Any) -> bool:
    """Whether `forward` is one that `compile_forward` installed."""
    return isinstance(forward, CompiledForward)


def compile_forward(module: nn.Module, options: dict[str, Any]) -> None:
    """Replaces `module.forward`, on the instance, with `torch.compile(module.forward, **options)`.

    Compiling twice is a no-op. The module keeps its class, parameters and state_dict keys.
    """
    if is_compiled_forward(module.__dict__.get("forward")):
        return
    module.forward = CompiledForward(module.forward, options)


def uncompiled(forward: Any) -> Any:
    """What `compile_forward` compiled into `forward`; `forward` itself when it is not compiled."""
    return forward.original if is_compiled_forward(forward) else forward


def remove_compiled_forward(module: nn.Module) -> None:
    """Undoes `compile_forward`: the class's own forward runs again (no-op when not compiled)."""
    forward = module.__dict__.get("forward")
    if not is_compiled_forward(forward):
        return
    original = uncompiled(forward)
    if getattr(original, "__self__", None) is module:  # the bound class forward: drop the instance attribute
        del module.forward
    else:  # a forward the instance had before (another wrapper): put it back
        module.forward = original


def remove_compile(module: nn.Module) -> None:
    """Undoes `compile_forward` on `module`, also under the precision wrapper, which stays
    (`unwrap_model(keep_torch_compile=False)`)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, AutocastForward):  # the fp32 wrapper stays, around the plain forward
        forward.original = uncompiled(forward.original)
    else:
        remove_compiled_forward(module)


def use_compile(accelerator: Any, options: dict[str, Any] | None) -> None:
    """Makes `accelerator` compile the models it prepares with `options` (Trainer(compile=...)).

    None leaves the accelerator as it is: one built with `dynamo_backend` still compiles.

    Raises:
        ValueError: when the accelerator was built to compile with other options.
    """
    if options is None:
        return
    own = accelerator.compile_options
    if own is not None and not same_options(own, options):
        raise ValueError(f"`compile` and the accelerator's dynamo_backend disagree. Received: "
                         f"compile={short_repr(options)}, "
                         f"while accelerator.compile_options={short_repr(own)}. Pass the options in one place: "
                         "Trainer(compile=...) with an Accelerator built without dynamo_backend, or the Accelerator's "
                         "dynamo_backend alone.")
    accelerator.compile_options = dict(options)
