"""Accelerate's `register_save_state_pre_hook` and `register_load_state_pre_hook`.

A save hook is called as `hook(models, weights, output_dir)` before `save_state` writes:
`weights` is the list of state dicts about to be written, one per model (a hook that saves a
model its own way, e.g. `model.save_pretrained(os.path.join(output_dir, "unet"))`, pops its
entry so fittrain does not write it too), and `output_dir` is a staging folder whose files
become part of the checkpoint: copied into it, committed atomically and checksummed with it.
A load hook is called as `hook(models, input_dir)` before `load_state` reads: it loads the
models it pops from `models` itself (from the checkpoint folder `input_dir`); fittrain loads the
others. Hooks pop from the end, as Accelerate's do: the models left are the first ones.
"""

from __future__ import annotations

import collections
import pathlib
import re
import shutil
import tempfile
from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

from fittrain.checkpoint.errors import CheckpointError

# The files save_state writes itself (checked when they are read); anything else came from a hook.
_OWN_FILE = re.compile(r"(model|optimizer|scheduler)(_\d+)?\.(safetensors|pt)|custom_checkpoint_\d+\.pt|"
                       r"(random|data)_states_\d+\.pt|scaler\.pt|accelerator_state\.json|shards/.*")


class StateHooks:
    """The save and load pre-hooks of one Accelerator, in the order they were registered."""

    def __init__(self) -> None:
        self.save: collections.OrderedDict[int, Callable[..., Any]] = collections.OrderedDict()
        self.load: collections.OrderedDict[int, Callable[..., Any]] = collections.OrderedDict()

    @staticmethod
    def register(table: collections.OrderedDict, hook: Callable[..., Any], method: str) -> RemovableHandle:
        """Adds `hook` to `table`; the handle's `remove()` takes it out again."""
        if not callable(hook):
            raise TypeError(f"{method}() takes a function. Received: {hook!r:.80} ({type(hook).__name__}).")
        handle = RemovableHandle(table)
        table[handle.id] = hook
        return handle

    def run_save(self, models: list[Any], weights: list[dict[str, Any]]) -> pathlib.Path | None:
        """Runs the save hooks with a fresh staging folder; returns it (None without hooks)."""
        if not self.save:
            return None
        staging = pathlib.Path(tempfile.mkdtemp(prefix="fittrain-save-hook-"))
        try:
            for hook in list(self.save.values()):
                hook(models, weights, str(staging))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if len(weights) > len(models):
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"A save_state pre-hook added weights: {len(weights)} for {len(models)} models. A "
                                  "hook may only remove entries (for the models it saves itself).")
        return staging

    def run_load(self, models: list[Any], input_dir: str, reader: Any) -> int:
        """Runs the load hooks; returns how many models (the first ones) fittrain still loads.

        The files that are not fittrain's own (what save hooks wrote) are checked against the
        manifest first, so a hook never reads a damaged file.
        """
        if not self.load:
            return len(models)
        reader.verify([name for name in reader.names() if not _OWN_FILE.fullmatch(name)])
        live = list(models)
        for hook in list(self.load.values()):
            hook(models, input_dir)
        if models != live[:len(models)]:
            raise CheckpointError("A load_state pre-hook reordered or replaced the models list. A hook may only pop "
                                  "models from its end (the ones it loads itself), as in Accelerate.")
        return len(models)
