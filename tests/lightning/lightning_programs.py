"""Small Lightning programs, written once against a namespace `pl` and run in this process with Lightning
(`lightning.pytorch`) and with `fittrain.lightning`, and the helpers that compare what they leave.

A test builds the same program with `api("lightning")` and `api("fittrain")`, runs both in tmp folders
and compares their records with `differences`: names and integers exactly, floats within a relative
1e-5 (fittrain reduces epoch means in float64, Lightning in float32: a few float32 ulps apart). The
programs are about Lightning's observable behaviour (hook counts, metric names, files), so they are
local here rather than the shared boring model of support/models.py, which is a native TrainModule.
Lightning is a test-only dependency ([dev]); the tests that need it skip without it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import pathlib
import types
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

LIBRARIES = ("lightning", "fittrain")
REL_TOL, ABS_TOL = 1e-5, 1e-6

#: Every Lightning callback hook the probes count (Lightning 2.x's callback API).
CALLBACK_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_validation_batch_start", "on_validation_batch_end", "on_test_start", "on_test_end", "on_test_epoch_start",
    "on_test_epoch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_start", "on_predict_end",
    "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start", "on_predict_batch_end",
)
#: The LightningModule hooks the probes count (those fittrain's module hooks have, plus setup/teardown).
MODULE_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
    "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_test_epoch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step",
)


def api(library: str) -> types.SimpleNamespace:
    """The namespace a program is written against: `pl`, `callbacks`, `loggers`."""
    if library == "lightning":
        pl = pytest.importorskip("lightning.pytorch")
        import lightning.pytorch.callbacks as callbacks
        import lightning.pytorch.loggers as loggers

        for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)  # its info lines (GPU available, ...) are noise here
    else:
        import fittrain.lightning as pl
        from fittrain.lightning import callbacks, loggers
    return types.SimpleNamespace(pl=pl, callbacks=callbacks, loggers=loggers, library=library)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Runs a program without the warnings both libraries give about tiny datasets and the like."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def dataset(n: int = 40, seed: int = 0) -> TensorDataset:
    """x ~ N(0, 1) in 3 features, y = their sum plus a little noise (so losses do not reach 0)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.3 * torch.randn(n, 1, generator=generator))


def loaders(n: int = 40, batch_size: int = 8) -> tuple[DataLoader, DataLoader]:
    """A shuffled training loader and an unshuffled validation loader over `dataset(n)`."""
    data = dataset(n)
    return DataLoader(data, batch_size=batch_size, shuffle=True), DataLoader(data, batch_size=batch_size)


def trainer_kwargs(root: pathlib.Path, **kwargs: Any) -> dict[str, Any]:
    """Quiet Trainer arguments in `root` (no bars, no summary), updated with `kwargs`."""
    return {"default_root_dir": str(root), "enable_progress_bar": False, "enable_model_summary": False, **kwargs}


def probe_module(pl: Any, logs: Callable[[Any, str, Any], None] | None = None,
                 optimizers: Callable[[Any], Any] | None = None) -> Any:
    """A LightningModule counting its hooks in `self.calls`, with a linear regression's steps.

    Args:
        pl: The namespace.
        logs: Called as `logs(module, place, loss)` in training_step ("train"), validation_step ("val"),
            test_step ("test") and the epoch-end hooks ("train_epoch_end", "val_epoch_end"); by default
            the training loss is logged with on_step and on_epoch and prog_bar, the others plainly.
        optimizers: `configure_optimizers`' body; by default SGD(lr=0.1).
    """

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)
            self.calls: collections.Counter = collections.Counter()
            self.seen: dict[str, list[Any]] = collections.defaultdict(list)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def _loss(self, batch: Any) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            (logs or _default_logs)(self, "train", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            (logs or _default_logs)(self, "val", self._loss(batch))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            (logs or _default_logs)(self, "test", self._loss(batch))

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            return optimizers(self) if optimizers else torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_epoch_end(self) -> None:
            self.calls["on_train_epoch_end"] += 1
            self.seen["callback_metrics_at_train_epoch_end"].append(sorted(self.trainer.callback_metrics))
            if logs:
                logs(self, "train_epoch_end", None)

        def on_validation_epoch_end(self) -> None:
            self.calls["on_validation_epoch_end"] += 1
            if logs:
                logs(self, "val_epoch_end", None)

    for name in MODULE_HOOKS:
        if name not in Probe.__dict__:
            setattr(Probe, name, _counting_module_hook(name))
    return Probe()


def _default_logs(module: Any, place: str, loss: Any) -> None:
    if place == "train":
        module.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        module.log("double", loss * 2)
    elif place in ("val", "test"):
        module.log(f"{place}_loss", loss)


def _counting_module_hook(name: str) -> Callable[..., None]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        stage = kwargs.get("stage", args[0] if args else None)
        stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum, a str
        self.calls[f"{name}:{stage}" if name in ("setup", "teardown") else name] += 1
    return hook


def probe_callback(pl: Any) -> Any:
    """A Lightning callback counting each hook (setup/teardown by stage) and noting `sanity_checking`
    at each validation end, in `calls` and `notes`."""

    class CountingCallback(pl.Callback):
        def __init__(self) -> None:
            self.calls: collections.Counter = collections.Counter()
            self.notes: dict[str, list[Any]] = collections.defaultdict(list)

    def counting(name: str) -> Callable[..., None]:
        def hook(self: Any, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
            stage = kwargs.get("stage", args[0] if args else None)
            stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn enum, a str
            self.calls[f"{name}:{stage}" if name in ("setup", "teardown") else name] += 1
            if name == "on_validation_end":
                self.notes["sanity_checking"].append(trainer.sanity_checking)
            if name == "on_train_batch_end":
                outputs = args[0]
                self.notes["outputs"].append(sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__)
                self.notes["batch_idx"].append(args[2])
        return hook

    for hook_name in CALLBACK_HOOKS:
        setattr(CountingCallback, hook_name, counting(hook_name))
    return CountingCallback()


def floats(values: dict[str, Any]) -> dict[str, float]:
    """A metric dict (tensors or numbers) as floats."""
    return {name: float(value) for name, value in values.items()}


def relative_files(root: pathlib.Path, below: str = "") -> list[str]:
    """Every file and folder under `root / below`, relative to `root`, sorted (event files' host and time
    parts are cut off: they name the machine and the clock)."""
    found = []
    for path in sorted((root / below).rglob("*")):
        name = path.relative_to(root).as_posix()
        if ".ckpt/" in name:
            continue  # inside a fittrain checkpoint (a folder where Lightning writes one file)
        found.append(name.split("events.out.tfevents")[0] + "events.out.tfevents" if "tfevents" in name else name)
    return found


def differences(lightning: Any, fittrain: Any, where: str = "") -> list[str]:
    """Every place where the fittrain record differs from Lightning's: keys, types, lengths and integers
    exactly, floats within REL_TOL (ABS_TOL near zero)."""
    if isinstance(lightning, dict) and isinstance(fittrain, dict):
        found = []
        for key in sorted(set(lightning) | set(fittrain), key=str):
            if key not in fittrain:
                found.append(f"{where}.{key}: missing on fittrain (Lightning: {lightning[key]!r})")
            elif key not in lightning:
                found.append(f"{where}.{key}: only on fittrain ({fittrain[key]!r})")
            else:
                found += differences(lightning[key], fittrain[key], f"{where}.{key}")
        return found
    if isinstance(lightning, (list, tuple)) and isinstance(fittrain, (list, tuple)) and len(lightning) == len(fittrain):
        return [d for i, (a, b) in enumerate(zip(lightning, fittrain)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(lightning, float) and isinstance(fittrain, (float, int)) and not isinstance(fittrain, bool):
        if math.isnan(lightning) and math.isnan(fittrain):
            return []
        close = math.isclose(lightning, fittrain, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        return [] if close else [f"{where}: Lightning {lightning!r}, fittrain {fittrain!r}"]
    if type(lightning) is not type(fittrain) or lightning != fittrain:
        return [f"{where}: Lightning {lightning!r}, fittrain {fittrain!r}"]
    return []


def both(run: Callable[[types.SimpleNamespace, pathlib.Path], Any], tmp_path: pathlib.Path) -> dict[str, Any]:
    """`run(api(library), folder)` for each library, in its own folder under tmp_path, from the same seed;
    their records by library. The working directory is the folder (Lightning writes some files there)."""
    records = {}
    for library in LIBRARIES:
        folder = tmp_path / library
        folder.mkdir()
        namespace = api(library)
        previous, environment = os.getcwd(), dict(os.environ)
        os.chdir(folder)
        try:
            namespace.pl.seed_everything(0)
            with quiet():
                records[library] = run(namespace, folder)
        finally:
            os.chdir(previous)
            for name in set(os.environ) - set(environment):  # PL_GLOBAL_SEED and the like stay with this run
                del os.environ[name]
    return records


def assert_same(records: dict[str, Any]) -> None:
    """Fails naming every difference between the two libraries' records."""
    found = differences(records["lightning"], records["fittrain"])
    assert not found, "fittrain.lightning differs from Lightning:\n" + "\n".join(found)
