"""`Checkpointing`: the Accelerator's checkpoint manager, as torchtitan's trainer owns a CheckpointManager.

It holds what `save_state` covers beyond the prepared objects (registered objects, save and load
hooks, the background writer) and runs the save and load flows; the Accelerator's
`save_state`, `load_state`, `save_model`, `register_for_checkpointing`, ... delegate to it. How
each model and optimizer is read and written (gathered, sharded) is the strategy's. The checkpoint
subsystem itself is `fittrain.checkpoint`: its package docstring maps the flows these methods run.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fittrain.accelerator.prepared import PreparedObjects
from fittrain.checkpoint.arguments import check_async_save, check_folder
from fittrain.checkpoint.background import BackgroundCheckpoints
from fittrain.checkpoint.checks import check_model_states, check_saved_values
from fittrain.checkpoint.hooks import StateHooks
from fittrain.checkpoint.latest import load_newest
from fittrain.checkpoint.model_io import load_model_weights, save_model_weights
from fittrain.checkpoint.naming import ProjectConfiguration, reserve_target
from fittrain.checkpoint.reader import CheckpointReader
from fittrain.checkpoint.restore import apply_state, read_state, undo_new_optimizer_state
from fittrain.checkpoint.run_folders import holds_checkpoints
from fittrain.checkpoint.sharded import METADATA_PATH, VALUES_NAME, ShardCheck, read_index, read_shards
from fittrain.checkpoint.snapshot import StateParts, capture_state, write_checkpoint
from fittrain.distributed import collectives
from fittrain.distributed.gradient_state import GradientState
from fittrain.distributed.process_state import ProcessState
from fittrain.distributed.strategies import Strategy
from fittrain.step.precision import FullPrecision


class Checkpointing:
    """Saves and restores everything an Accelerator prepared, plus registered objects.

    Args:
        state: This process's place in the run.
        strategy: The run's strategy, which reads and writes each model's and optimizer's state.
        prepared: The Accelerator's prepared objects (the same object: prepare adds to it).
        gradient_state: The accumulation counter, saved as the step.
        project_configuration: Checkpoint naming, limits and folders.
        precision: The precision object (its fp16 scaler is saved); the Accelerator replaces it
            when `mixed_precision` is set.
        state_dict_type: "full" or "sharded" (`resolve_state_dict_type`); read at every save.
    """

    def __init__(self, state: ProcessState, strategy: Strategy, prepared: PreparedObjects,
                 gradient_state: GradientState, project_configuration: ProjectConfiguration,
                 precision: FullPrecision, state_dict_type: str) -> None:
        self.state = state
        self.strategy = strategy
        self.prepared = prepared
        self.gradient_state = gradient_state
        self.project_configuration = project_configuration
        self.precision = precision
        self.state_dict_type = state_dict_type
        #: Objects whose `state_dict()` travels in every save (`register_for_checkpointing`).
        self.custom_objects: list[Any] = []
        self.hooks = StateHooks()
        #: Made at the first `save_state(async_save=True)`; it keeps the CPU copy for the next one.
        self.background: BackgroundCheckpoints | None = None

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Adds objects whose `state_dict()` travels in every `save_state`.

        Raises:
            ValueError: for an object without both `state_dict` and `load_state_dict`.
        """
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise ValueError(
                    "register_for_checkpointing() needs objects with state_dict() and load_state_dict() methods. "
                    f"Received: {obj!r} (type {type(obj).__name__}), which lacks them. Add both methods."
                )
        self.custom_objects.extend(objects)

    def _state_parts(self, gather: bool = True) -> StateParts:
        """The live objects a checkpoint covers; `gather=False` (for loading) skips collecting their
        state dicts, leaving empty placeholders, one per model and optimizer. A sharded save takes
        each rank's shards instead of gathering (`sharded`)."""
        models, optimizers, strategy = self.prepared.models, self.prepared.optimizers, self.strategy
        sharded = self._sharded_states(len(models)) if gather and self.state_dict_type == "sharded" else None
        if sharded is not None:  # nothing gathered, and no model or optimizer file written
            model_states, optimizer_states = [], []
        elif gather:
            model_states = [self.get_state_dict(m) for m in models]
            optimizer_states = [strategy.optimizer_state_dict(o, models) for o in optimizers]
        else:
            model_states, optimizer_states = [{} for _ in models], [{} for _ in optimizers]
        return StateParts(
            model_state_dicts=model_states, optimizer_state_dicts=optimizer_states,
            sharded=sharded,
            optimizers=optimizers, schedulers=self.prepared.schedulers, dataloaders=self.prepared.dataloaders,
            custom=self.custom_objects, precision=self.precision,
            # The optimizers' classes let a load refuse another optimizer's state by name.
            accelerator_state={"step": self.gradient_state.batches_seen, "num_processes": self.state.num_processes,
                               "mixed_precision": self.precision.name, "state_dict_type": self.state_dict_type,
                               "optimizer_types": [type(getattr(o, "optimizer", o)).__name__ for o in optimizers]})

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (gathered from every rank under FSDP2; call it on all).

        With `unwrap=False` the keys are those of the wrapped model (DDP's `module.` prefix).
        """
        return self.strategy.full_state_dict(model, unwrap)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Writes the unwrapped model's weights as safetensors (sharded past `max_shard_size`).

        Every process must call it under FSDP2, which gathers the weights one tensor at a time,
        streaming them shard by shard: no process holds more than one file's worth of the
        model. Only the main process writes.
        """
        streamed = self.strategy.streamed_weights(model)
        if streamed is not None:
            weights, materialize = streamed
            save_model_weights(weights, save_directory, max_shard_size, safe_serialization,
                               materialize=materialize, is_main_process=self.state.is_main_process)
        elif self.state.is_main_process:
            save_model_weights(self.get_state_dict(model), save_directory, max_shard_size, safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Saves `obj` with torch.save (or safetensors) from the main process only."""
        if not self.state.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file  # only for this format; torch.save is the default

            save_file(obj, os.fspath(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def save_state(self, output_dir: str | os.PathLike | None = None, async_save: bool = False,
                   safe_serialization: bool = True, **kwargs: Any) -> str:
        """Saves models, optimizers, schedulers, scaler, RNG, data positions and registered objects.

        The folder is written under a temporary name and renamed when complete, so a crash never
        leaves a folder that looks complete. With automatic naming, `output_dir` is chosen as
        `{project_dir}/checkpoints/checkpoint_{i}` and old ones beyond `total_limit` are deleted.
        A save still being written in the background is waited for first.

        Args:
            output_dir: The folder to write; None with automatic naming.
            async_save: Write the files on a background thread and return at once. What changes
                outside optimizer steps is copied at the call; the parameters and optimizer
                state are copied to CPU memory by that thread, and the next optimizer step waits
                for it (an in-place change by other means before then fails the save). The folder
                appears (and pruning happens) when the write is done; `wait_for_checkpoint()`
                waits for it. The CPU copy is kept for the next async save to reuse. Every process
                must pass the same value.

        Returns:
            The folder written (or being written, with `async_save`).
        """
        _refuse_options("save_state", kwargs)
        check_folder(output_dir, "save_state", "output_dir")
        check_async_save(async_save, "save_state")
        if safe_serialization is not True:
            raise ValueError("save_state(safe_serialization=False) is not supported: fittrain writes model weights as "
                             f"safetensors, always (nothing is pickled). Received: safe_serialization="
                             f"{safe_serialization!r}. Leave it out.")
        self.wait_for_checkpoint()
        config = self.project_configuration
        reserved = None
        if config.automatic_checkpoint_naming:
            # Claimed now, on this thread: another writer of the project (a job, an Accelerator)
            # never gets this number, and a background write needs none of its own.
            target, reserved = reserve_target(
                config, self.state.is_main_process, lambda obj: collectives.broadcast_object(obj, self.state))
        elif output_dir is None:
            raise ValueError("save_state() needs `output_dir`, or a ProjectConfiguration with "
                             "automatic_checkpoint_naming=True. Received: output_dir=None.")
        else:
            target = pathlib.Path(output_dir)
            self._check_same_folder(target)
        try:
            if async_save and self.background is None:
                self.background = BackgroundCheckpoints(self.state)
            stage = self.background.stager() if async_save else None
            # Collectives (FSDP2's gathering) run here, on this thread, before any background write.
            parts = self._state_parts()
            staging = self._run_save_hooks(parts)
            snapshot = capture_state(parts, self.state.process_index, self.state.is_main_process, stage,
                                     self._parameter_storage() if async_save else None)
            if async_save:  # parameters and optimizer state are copied on the writing thread
                snapshot.fill = self.background.fill
                self.background.guard(self.prepared.optimizers)
            prune = config.prune if config.automatic_checkpoint_naming and self.state.is_main_process else None

            def write(barrier: Callable[[], None], group: Any = None) -> None:
                try:
                    write_checkpoint(target, snapshot, barrier, prune, reserved, staging, group)
                finally:
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)

            if async_save:
                self.background.start(target, write)
            else:
                write(self.state.barrier)
        except BaseException:
            if reserved is not None:
                reserved.release()  # does nothing once the folder is committed
            raise
        return os.fspath(target)

    def _parameter_storage(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor is (a view of) a prepared model's parameter, this rank's shard of one under
        FSDP2: what only an optimizer step changes, unlike a buffer, which forward passes update."""
        def local(p: torch.Tensor) -> torch.Tensor:
            return p.to_local() if hasattr(p, "to_local") else p

        storages = {local(p).untyped_storage().data_ptr() for m in self.prepared.models for p in m.parameters()}
        return lambda tensor: tensor.untyped_storage().data_ptr() in storages

    def _sharded_states(self, models: int) -> dict[str, Any]:
        """This rank's own shards of the first `models` models and of every optimizer (no gathering)."""
        prepared, strategy = self.prepared, self.strategy
        states = {f"model_{i}": strategy.sharded_state_dict(m) for i, m in enumerate(prepared.models[:models])}
        states.update((f"optimizer_{i}", strategy.sharded_optimizer_state_dict(o, prepared.models))
                      for i, o in enumerate(prepared.optimizers))
        return states

    def _run_save_hooks(self, parts: StateParts) -> pathlib.Path | None:
        """Runs the save pre-hooks on the weights about to be written; a model whose entry a hook
        popped is left out of a sharded checkpoint too."""
        if parts.sharded is None:
            return self.hooks.run_save(list(self.prepared.models), parts.model_state_dicts)
        weights = [parts.sharded[f"model_{i}"] for i in range(len(self.prepared.models))]
        staging = self.hooks.run_save(list(self.prepared.models), weights)
        for i in range(len(weights), len(self.prepared.models)):
            del parts.sharded[f"model_{i}"]
        return staging

    def restore_weights(self, folder: str | os.PathLike, model: nn.Module) -> None:
        """Loads only `model`'s weights (a prepared model) from a checkpoint folder; every process calls it.

        A sharded checkpoint loads each rank's shard (nothing is gathered); a full one is read
        whole and resharded under FSDP2. `Checkpointer(restore_best=True)` uses it.
        """
        with CheckpointReader(folder) as reader:  # closing the shard files it holds
            if not reader.has(METADATA_PATH):
                self.strategy.load_full_state_dict(model, load_model_weights(folder))
                return
            check = ShardCheck(reader, self.state.process_index, self.state.num_processes)
            index = read_index(reader)
            check.wait(self._share)
            own = self.strategy.unwrap(model)
            i = next(i for i, m in enumerate(self.prepared.models) if self.strategy.unwrap(m) is own)
            name = f"model_{i}"
            live = {name: self.strategy.sharded_state_dict(model)}
            check_saved_values(reader.path / VALUES_NAME, name, live[name], index[1].get(name, {}))
            filled = read_shards(reader, live, index)  # DCP reads into the live weights: checked first
            self.strategy.load_sharded_state_dict(model, filled[name])

    def _share(self, value: Any) -> list[Any]:
        """`value` from every process, on every process (so that all of them refuse a damaged shard)."""
        return collectives.gather_object(value, self.state)

    def _load_shards(self, reader: CheckpointReader, index: Any, models: int, states: dict[str, Any]) -> None:
        """Loads a sharded checkpoint's models (the first `models`) and optimizers (collective) into
        `states`, their live sharded states that `read_state` checked it against."""
        filled = read_shards(reader, states, index)
        prepared, strategy = self.prepared, self.strategy
        for i in range(models):
            strategy.load_sharded_state_dict(prepared.models[i], filled[f"model_{i}"])
        for i, optimizer in enumerate(prepared.optimizers):
            strategy.load_sharded_optimizer_state_dict(optimizer, prepared.models, filled[f"optimizer_{i}"])

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Registers `hook(models, weights, output_dir)`, called by `save_state` before it writes.

        `weights` holds the state dict of each model about to be written: pop the entries of the
        models the hook saves itself. Files the hook writes into `output_dir` (a staging folder)
        become part of the checkpoint, committed and checksummed with it; subfolders are fine.
        See `fittrain.checkpoint.hooks`.

        Returns:
            A handle whose `remove()` unregisters the hook.
        """
        return self.hooks.register(self.hooks.save, hook, "register_save_state_pre_hook")

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Registers `hook(models, input_dir)`, called by `load_state` before it reads the models.

        The hook loads the models it pops from the end of `models` itself (from `input_dir`, the
        checkpoint folder, where a save hook's files are); `load_state` loads the others.

        Returns:
            A handle whose `remove()` unregisters the hook.
        """
        return self.hooks.register(self.hooks.load, hook, "register_load_state_pre_hook")

    def _check_same_folder(self, target: pathlib.Path) -> None:
        """Refuses a save to different folders on different processes (one small gather).

        A checkpoint is one folder that every process writes its files into and the main process
        commits; a process writing elsewhere would find no folder to write into.
        """
        if not self.state.is_distributed:
            return
        folders = collectives.gather_object(os.path.abspath(target), self.state)
        if len(set(folders)) > 1:
            listed = ", ".join(f"process {rank}: {folder!r}" for rank, folder in enumerate(folders))
            raise ValueError(f"save_state() got a different output_dir on each process ({listed}). A checkpoint is one "
                             "folder, shared by every process (each writes its own files into it, the main process "
                             "commits it): pass the same path everywhere, on a file system all processes see, or use "
                             "ProjectConfiguration(automatic_checkpoint_naming=True).")

    def wait_for_checkpoint(self) -> None:
        """Blocks until the checkpoint that `save_state(async_save=True)` is writing is complete.

        Returns at once when no write is in flight. `save_state`, `load_state` and `end_training`
        call it themselves; call it before reading the folder, or before the script exits.

        Raises:
            Exception: whatever the background write raised, with a note naming the folder; that
                checkpoint was not saved (earlier ones are intact).
        """
        if self.background is not None:
            self.background.wait()

    def release_buffers(self) -> None:
        """Waits for a write in flight, then frees the CPU copy that async saves keep (`free_memory`)."""
        self.wait_for_checkpoint()
        if self.background is not None:
            self.background.release_buffers()

    def close(self) -> None:
        """Waits for a write in flight and stops the background writer (`end_training`); raises its error."""
        if self.background is not None:
            self.background.close()

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True,
                   **kwargs: Any) -> str | None:
        """Restores everything `save_state` saved. Data loaders get their position back but are not
        moved: pass the resumed step count to `skip_first_batches` to continue mid-epoch.

        With `input_dir=None` and automatic naming, loads the newest intact checkpoint: one found
        damaged (by its checksums, or when a file is refused as it is read) is passed over with a
        warning, and the next older one is loaded. `input_dir="auto"` does the same where a
        checkpoint was saved, and where none was, loads nothing, says so in one line and returns
        None: one script serves a job's first launch and its requeues.

        Raises:
            FileNotFoundError: when the folder does not exist (or no checkpoint is left to load;
                with "auto", when checkpoints were saved but none is intact).
            CheckpointError: when a file is missing, truncated, corrupt or not a plain-tensor file,
                or (`CheckpointMismatchError`) the checkpoint does not fit this run: other models or
                optimizers, another mixed_precision or number of processes. Nothing is changed.

        Returns:
            The folder loaded (None for "auto" with nothing saved).
        """
        _refuse_options("load_state", kwargs)
        check_folder(input_dir, "load_state", "input_dir")
        if strict is not True:
            raise ValueError("load_state(strict=False) is not supported: a checkpoint loads into the same models, "
                             f"whole, or not at all. Received: strict={strict!r}. To load part of a model's weights, "
                             "read them with fittrain.checkpoint.load_model_weights(folder) and call "
                             "model.load_state_dict(weights, strict=False).")
        self.wait_for_checkpoint()
        auto = input_dir is not None and os.fspath(input_dir) == "auto"
        if input_dir is not None and not auto:
            return self._load_folder(pathlib.Path(input_dir))
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError(f"load_state({'' if input_dir is None else repr('auto')}) needs a ProjectConfiguration "
                             f"with automatic_checkpoint_naming=True, which says where checkpoints go. Received: "
                             f"input_dir={input_dir!r}. Pass one to Accelerator(project_config=...), or pass the "
                             "checkpoint folder to load.")
        root = self.project_configuration.checkpoints_dir
        if auto and not holds_checkpoints(root):
            self.state.print(f"load_state('auto'): nothing saved under {str(root)!r} yet, so nothing was loaded.")
            return None
        try:
            return load_newest(root, warnings.warn, self._load_folder)
        except FileNotFoundError as missing:
            if not auto:
                raise
            raise FileNotFoundError(
                f"load_state('auto') found checkpoints under {str(root)!r}, but none that loads, so it does not start "
                f"afresh over them. Received: input_dir='auto'. Detail: {missing} Pass a checkpoint folder to load "
                "one, or move the folder away to start afresh.") from None

    def _load_folder(self, source: pathlib.Path) -> str:
        """Reads and checks every file of `source`, then applies them; returns the folder loaded."""
        # A sharded load holds its shard files until the end; DCP's optimizer state made for a load
        # that is then refused is removed again.
        prepared, strategy = self.prepared, self.strategy
        with CheckpointReader(source) as reader, undo_new_optimizer_state(prepared.optimizers):
            kept = self.hooks.run_load(list(prepared.models), os.fspath(source), reader)
            parts = self._state_parts(gather=False)
            parts = dataclasses.replace(parts, model_state_dicts=parts.model_state_dicts[:kept])
            # Every file is read and checked before anything changes: a refused checkpoint changes nothing.
            loaded = read_state(reader, parts, self.state.process_index, self._share,
                                lambda: self._sharded_states(kept))
            check_model_states(reader.path, loaded["models"],
                               [strategy.unwrap(m).state_dict() for m in prepared.models[:kept]])
            apply_state(
                loaded, parts, lambda i, sd: strategy.load_full_state_dict(prepared.models[i], sd),
                lambda i, sd: strategy.load_optimizer_state_dict(prepared.optimizers[i], prepared.models, sd),
                lambda index, states: self._load_shards(reader, index, kept, states))
        self.gradient_state.batches_seen = loaded["meta"]["step"]
        self.project_configuration.after_load(source)
        return os.fspath(source)


def _refuse_options(method: str, options: dict[str, Any]) -> None:
    """Accelerate passes unknown keywords on to torch; fittrain names them instead of ignoring them."""
    if options:
        raise TypeError(f"{method}() got keyword arguments fittrain does not take: {', '.join(sorted(options))}. "
                        f"Received: {options!r:.120}. Remove them (fittrain's checkpoints need no save or load "
                        "options; see docs/checkpoints.md).")


# Accelerate's FSDP plugin names, accepted as they are.
_STATE_DICT_TYPES = {"full": "full", "sharded": "sharded", "full_state_dict": "full", "sharded_state_dict": "sharded"}


def resolve_state_dict_type(value: str | None, default: str) -> str:
    """"full" or "sharded": the value given, else Accelerate's FSDP_STATE_DICT_TYPE variable, else
    `default`, the strategy's (`Strategy.default_state_dict_type`).

    Raises:
        ValueError: for any other value, naming it.
    """
    source = "state_dict_type"
    if value is None and os.environ.get("FSDP_STATE_DICT_TYPE"):
        value, source = os.environ["FSDP_STATE_DICT_TYPE"], "the FSDP_STATE_DICT_TYPE environment variable"
    if value is None:
        return default
    resolved = _STATE_DICT_TYPES.get(value.lower()) if isinstance(value, str) else None
    if resolved is None:
        raise ValueError(f"Accelerator(state_dict_type=...) must be 'full' or 'sharded' (or Accelerate's "
                         f"'FULL_STATE_DICT' / 'SHARDED_STATE_DICT'). Received: {value!r} from {source}.")
    return resolved
