"""Loading checkpoints: everything is checked before anything changes, and nothing on disk can crash
a load, stall "latest" or keep a pruned folder's disk space.

- A checkpoint whose accelerator_state.json, RNG file, or trainer/callback state is wrong (or
  missing) is refused with a CheckpointError naming the file, and the live model, optimizer,
  scheduler, RNG and registered objects are exactly as before.
- Another optimizer type, mixed_precision or process count is refused before anything is loaded.
- A hostile manifest or accelerator_state.json (nested 100,000 deep, too large, wrong types) is a
  damaged checkpoint: "latest" skips it with a warning, and an explicit load names the file.
- Loaded state keeps no file of the checkpoint mapped (its disk space is freed when it is pruned).
- A folder pruned while it is read is reported as deleted, never as damaged, and "latest" moves on
  to the newer checkpoint without a warning, even with a real concurrent pruner.

Every checkpoint is a real folder written by save_state, then edited on disk. An edit that must get
past the checksums rewrites the manifest's size and CRC32 for that file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import random
import re
import sys
import threading
import warnings
import zlib
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, CheckpointError, ProjectConfiguration, TrainState
from fittrain.callbacks import EarlyStop
from fittrain.checkpoint import CheckpointDeletedError, CheckpointReader, is_intact, latest_checkpoint
from fittrain.checkpoint import reader as reader_module
from fittrain.trainer.callback_states import CallbackStates
from support.models import Regressor, regression_loader


class Counter:
    """A registered object whose load assigns `count` before it can fail on `total`."""

    def __init__(self) -> None:
        self.count, self.total = 0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.total = float(state["total"])


class Run:
    """A prepared model, optimizer, scheduler and loader, plus the objects the Trainer registers
    (its TrainState and the callbacks' states) after a Counter of our own."""

    def __init__(self, seed: int = 0, optimizer: str = "adamw", mixed_precision: str = "no",
                 project: pathlib.Path | None = None, total_limit: int | None = None, hidden: int = 8) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        config = ProjectConfiguration(os.fspath(project) if project else None, total_limit=total_limit,
                                      automatic_checkpoint_naming=project is not None)
        self.acc = Accelerator(cpu=True, mixed_precision=mixed_precision, project_config=config)
        model = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9 ** step)
        x = torch.randn(32, 4)
        loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, opt, sched, loader)
        self.counter, self.train_state, self.stopper = Counter(), TrainState(), EarlyStop(patience=3)
        self.acc.register_for_checkpointing(self.counter, self.train_state, CallbackStates([self.stopper]))
        self.batches = iter(self.loader)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            inputs, targets = next(self.batches)
            self.acc.backward(nn.functional.mse_loss(self.model(inputs), targets))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.counter.count += 1
            self.counter.total += 0.5
            self.train_state.global_step += 1
            self.train_state.epoch += 1
            self.stopper.best, self.stopper.wait = 1.0 / self.counter.count, self.counter.count

    def live(self) -> dict[str, Any]:
        """Copies of everything a load changes."""
        opt = self.opt.state_dict()
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "optimizer": [v.clone() for s in opt["state"].values() for v in s.values()],
            "lr": [g["lr"] for g in opt["param_groups"]],
            "scheduler": self.sched.state_dict(),
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state()[1].copy(),
            "registered": (self.counter.state_dict(), self.train_state.state_dict(), self.stopper.state_dict()),
            "loader": self.loader.state_dict(), "step": self.acc.step,
        }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("params", "optimizer"):
        assert len(before[key]) == len(after[key]) and all(
            torch.equal(a, b) for a, b in zip(before[key], after[key])), key
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert np.array_equal(before["numpy_rng"], after["numpy_rng"])
    for key in ("lr", "scheduler", "python_rng", "registered", "step"):
        assert before[key] == after[key], key
    torch.testing.assert_close(after["loader"], before["loader"], rtol=0, atol=0)  # it may hold RNG tensors


def rewrite_manifest(folder: pathlib.Path, name: str) -> None:
    """Makes the manifest agree with `name` as it is now on disk (or drop it when it is gone)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if (folder / name).exists():
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    else:
        del manifest["files"][name]
    (folder / "manifest.json").write_text(json.dumps(manifest))


META, RNG, DATA = "accelerator_state.json", "random_states_0.pt", "data_states_0.pt"


def damage(folder: pathlib.Path, name: str, change: Any) -> None:
    """Changes file `name` and makes the manifest agree: `change` maps its decoded contents to new
    ones, or is bytes to write, or None to delete the file. The manifest itself is only overwritten."""
    path = folder / name
    if change is None:
        path.unlink()
    elif isinstance(change, bytes):
        path.write_bytes(change)
    elif name.endswith(".json"):
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
    else:
        torch.save(change(torch.load(path, weights_only=True)), path)
    if name != "manifest.json":
        rewrite_manifest(folder, name)


def without(key: str) -> Callable[[dict], dict]:
    return lambda state: {k: v for k, v in state.items() if k != key}


def with_item(key: str, value: Any) -> Callable[[dict], dict]:
    return lambda state: {**state, key: value}


@pytest.fixture
def saved(tmp_path):
    """A checkpoint after 2 steps, and the run trained 2 steps past it (so a load would show)."""
    run = Run()
    run.step(2)
    folder = tmp_path / "ckpt"
    run.acc.save_state(folder)
    run.step(2)
    return run, folder


# ------------------------------------------------------------------ 1. refused before anything changes
CORRUPTIONS = {
    "accelerator_state.json: step is a list": (META, with_item("step", [3])),
    "accelerator_state.json: num_processes is a string": (META, with_item("num_processes", "1")),
    "accelerator_state.json: mixed_precision is missing": (META, without("mixed_precision")),
    "accelerator_state.json: a data position's seed is text": (
        META, lambda meta: {**meta, "dataloaders": [{**meta["dataloaders"][0], "seed": "x"}]}),
    "accelerator_state.json: dataloaders is a dict": (META, with_item("dataloaders", {"0": 1})),
    "accelerator_state.json: a list, not an object": (META, lambda meta: [meta]),
    "accelerator_state.json is missing": (META, None),
    "RNG: torch state of the wrong size": (RNG, with_item("torch", torch.zeros(3, dtype=torch.uint8))),
    "RNG: numpy position out of range": (RNG, with_item("numpy_pos", 10 ** 6)),
    "RNG: python state missing": (RNG, without("python_state")),
    "RNG: a list, not a dict": (RNG, lambda state: [1, 2]),
    "registered object: refuses its state half-way": ("custom_checkpoint_0.pt", with_item("total", "lots")),
    "trainer state: refuses its state half-way": ("custom_checkpoint_1.pt", with_item("batch_idx", "first")),
    "trainer state: not a dict": ("custom_checkpoint_1.pt", lambda state: [state]),
    "callback state: refuses its state half-way": (
        "custom_checkpoint_2.pt", lambda states: {k: {"best": 0.5, "wait": "long"} for k in states}),
    "scheduler: refuses its state": ("scheduler.pt", lambda state: {"last_epoch": 9}),
    "data states: a dict, not a list": (DATA, lambda states: {"0": states}),
    "data states: one loader too many": (DATA, lambda states: states + states),
    "data state: batches_consumed is negative": (DATA, lambda states: [{**states[0], "batches_consumed": -2}]),
    "data state: epoch is missing": (DATA, lambda states: [without("epoch")(states[0])]),
    "data states are missing": (DATA, None),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_refused_checkpoint_names_the_file_and_changes_nothing(saved, corruption):
    run, folder = saved
    culprit, change = CORRUPTIONS[corruption]
    damage(folder, culprit, change)
    before = run.live()
    with pytest.raises(CheckpointError) as info:
        run.acc.load_state(folder)
    assert culprit in str(info.value)
    assert_unchanged(before, run.live())


def test_the_checks_let_an_intact_checkpoint_load_completely(saved):
    """The control: the same checkpoint, untouched, loads and restores every piece, so the
    comparisons above would see a load."""
    run, folder = saved
    at_save = Run()  # the same seeds and steps as the run that saved, up to the save
    at_save.step(2)
    want = at_save.live()
    run.acc.load_state(folder)
    assert_unchanged(want, run.live())


# ------------------------------------------------------------------ 2. mismatches a resume cannot honour
def test_an_sgd_checkpoint_is_refused_by_adam(tmp_path):
    sgd = Run(optimizer="sgd")
    sgd.step(2)
    sgd.acc.save_state(tmp_path / "ckpt")
    adam = Run(optimizer="adamw")
    before = adam.live()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*SGD.*AdamW"):
        adam.acc.load_state(tmp_path / "ckpt")
    assert_unchanged(before, adam.live())


def test_another_optimizers_hyperparameters_are_refused_without_the_recorded_type(tmp_path):
    """A checkpoint that does not record the optimizer class is still refused on its hyperparameters."""
    sgd = Run(optimizer="sgd")
    sgd.step(2)
    folder = tmp_path / "ckpt"
    sgd.acc.save_state(folder)
    damage(folder, META, without("optimizer_types"))
    adam = Run(optimizer="adamw")
    before = adam.live()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*'betas'"):
        adam.acc.load_state(folder)
    assert_unchanged(before, adam.live())


def test_per_parameter_state_of_another_kind_is_refused(tmp_path):
    """With the type and hyperparameters edited to look right, the per-parameter state keys differ."""
    adam = Run(optimizer="adamw")
    adam.step(2)
    folder = tmp_path / "ckpt"
    adam.acc.save_state(folder)

    def fake_state(state: dict) -> dict:
        return {**state, "state": {i: {"momentum_buffer": s["exp_avg"]} for i, s in state["state"].items()}}
    damage(folder, "optimizer.pt", fake_state)
    other = Run(optimizer="adamw")
    other.step(1)  # the live optimizer has per-parameter state to compare with
    before = other.live()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*momentum_buffer"):
        other.acc.load_state(folder)
    assert_unchanged(before, other.live())


def test_another_mixed_precision_is_refused(tmp_path):
    plain = Run(mixed_precision="no")
    plain.step(1)
    plain.acc.save_state(tmp_path / "ckpt")
    fp16 = Run(mixed_precision="fp16")
    before = fp16.live()
    with pytest.raises(CheckpointError, match=r"accelerator_state\.json.*mixed_precision='no'.*'fp16'") as info:
        fp16.acc.load_state(tmp_path / "ckpt")
    assert "Resume with mixed_precision='no'" in str(info.value)
    assert_unchanged(before, fp16.live())


# ------------------------------------------------------------------ 3. hostile files never crash or block "latest"
def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def project_with_two_checkpoints(tmp_path: pathlib.Path) -> tuple[Run, pathlib.Path, dict[str, Any]]:
    run = Run(project=tmp_path)
    run.step(1)
    run.acc.save_state()
    first = run.live()
    run.step(1)
    run.acc.save_state()
    run.step(1)
    return run, tmp_path / "checkpoints", first


HOSTILE = {
    "manifest.json nested 100,000 deep": ("manifest.json", nested(100_000)),
    "accelerator_state.json nested 100,000 deep": (META, nested(100_000)),
    "accelerator_state.json nested 50 deep": (META, with_item("step", json.loads(nested(50)))),  # parses, but too deep
    "accelerator_state.json is not JSON": (META, b"\xff{garbage"),
    "accelerator_state.json of the wrong types": (META, with_item("step", "many")),
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_latest_skips_a_hostile_json_file_with_a_warning(tmp_path, hostile):
    run, root, first = project_with_two_checkpoints(tmp_path)
    culprit, change = HOSTILE[hostile]
    damage(root / "checkpoint_1", culprit, change)
    # is_intact checks files against the manifest only: a hostile accelerator_state.json matches it.
    assert is_intact(root / "checkpoint_1") is (culprit != "manifest.json")
    with pytest.warns(UserWarning, match=f"checkpoint_1.*{culprit}"):
        loaded = run.acc.load_state()
    assert pathlib.Path(loaded).name == "checkpoint_0"
    assert all(torch.equal(a, b) for a, b in zip(run.live()["params"], first["params"]))


@pytest.mark.parametrize("hostile", sorted(set(HOSTILE) - {"accelerator_state.json is not JSON"}))
def test_an_explicit_load_of_a_hostile_json_file_names_it(tmp_path, hostile):
    run, root, _ = project_with_two_checkpoints(tmp_path)
    culprit, change = HOSTILE[hostile]
    damage(root / "checkpoint_1", culprit, change)
    before = run.live()
    with pytest.raises(CheckpointError, match=culprit.replace(".", r"\.")):
        run.acc.load_state(root / "checkpoint_1")
    assert_unchanged(before, run.live())


class Planted:
    """Unpickling this creates the file `marker` (it calls open(marker, 'w'))."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def planted_pickle(marker: pathlib.Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"state": Planted(marker)}, buffer)
    return buffer.getvalue()


REFUSED_WHEN_READ = ["optimizer.pt", "scheduler.pt", RNG, "custom_checkpoint_1.pt", "model.safetensors"]


@pytest.mark.parametrize("name", REFUSED_WHEN_READ)
def test_load_state_of_the_newest_passes_over_a_planted_pickle_with_a_warning(tmp_path, name):
    """The checksums match (the manifest was rewritten): the refusal comes when the file is read."""
    run, root, first = project_with_two_checkpoints(tmp_path)
    marker = tmp_path / "executed"
    damage(root / "checkpoint_1", name, planted_pickle(marker))
    with pytest.warns(UserWarning, match=f"checkpoint_1.*{name}"):
        loaded = run.acc.load_state()
    assert pathlib.Path(loaded).name == "checkpoint_0" and not marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(run.live()["params"], first["params"]))


@pytest.mark.parametrize("name, change", [("optimizer.pt", lambda state: [state]),
                                          ("scheduler.pt", lambda state: [state]),
                                          (RNG, lambda state: {k: str(v) for k, v in state.items()})],
                         ids=["optimizer.pt a list", "scheduler.pt a list", "RNG states as strings"])
def test_load_state_of_the_newest_passes_over_contents_of_the_wrong_kind(tmp_path, name, change):
    run, root, _ = project_with_two_checkpoints(tmp_path)
    damage(root / "checkpoint_1", name, change)
    with pytest.warns(UserWarning, match=f"checkpoint_1.*{name}"):
        assert pathlib.Path(run.acc.load_state()).name == "checkpoint_0"


def test_load_state_of_the_newest_does_not_pass_over_a_mismatch(tmp_path):
    """An older checkpoint would not fit either: the mismatch is raised, naming the newest."""
    run, root, _ = project_with_two_checkpoints(tmp_path)
    damage(root / "checkpoint_1", META, with_item("mixed_precision", "fp16"))
    before = run.live()
    with pytest.raises(CheckpointError, match=r"checkpoint_1.*accelerator_state\.json.*mixed_precision='fp16'"):
        run.acc.load_state()
    assert_unchanged(before, run.live())


def test_an_oversized_json_file_is_refused_unread(saved, monkeypatch):
    run, folder = saved
    # The real cap is 64 MiB, slow to fill in a test; the check is the same.
    monkeypatch.setattr(reader_module, "_JSON_MAX_BYTES", 4096)
    damage(folder, META, with_item("padding", "x" * 5000))
    with pytest.raises(CheckpointError, match=r"accelerator_state\.json.*more than the 4096"):
        run.acc.load_state(folder)


def test_trainer_resume_latest_goes_through_the_same_checks(tmp_path):
    """Trainer(resume_from="latest") skips the hostile newest checkpoint the same way."""
    from fittrain import Callback, Trainer
    from fittrain.callbacks import Checkpointer
    from fittrain.checkpoint.run_folders import run_folder

    data = regression_loader(8, batch_size=2)
    Trainer(max_steps=2, project_dir=tmp_path, callbacks=[Checkpointer(every_n_steps=1)]).fit(Regressor(), data)
    root = run_folder(tmp_path)  # the run's checkpoints
    (root / "checkpoint_1" / "manifest.json").write_bytes(nested(100_000))
    seen = []

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer) -> None:
            seen.append(trainer.state.global_step)

    with pytest.warns(UserWarning, match=r"checkpoint_1.*manifest\.json"):
        Trainer(max_steps=2, project_dir=tmp_path, resume_from="latest", callbacks=[FirstStep()]).fit(Regressor(), data)
    assert seen == [1]  # resumed from checkpoint_0, saved after step 1


# ------------------------------------------------------------------ 4. nothing stays mapped
def mapped_files_under(folder: pathlib.Path) -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line.split()[-1] for line in maps if str(folder.resolve()) in line]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_loaded_state_keeps_no_checkpoint_file_mapped(saved):
    run, folder = saved
    run.acc.load_state(folder)
    assert mapped_files_under(folder) == []
    reader = CheckpointReader(folder)
    weights, optimizer = reader.read_tensors("model.safetensors"), reader.read_torch("optimizer.pt")
    assert mapped_files_under(folder) == []
    # Loaded tensors are writable memory of their own, equal to what was saved.
    assert torch.equal(weights["0.weight"], run.acc.unwrap_model(run.model).state_dict()["0.weight"])
    weights["0.weight"].add_(1)
    optimizer["state"][0]["exp_avg"].add_(1)
    assert reader.read_tensors("model.safetensors")["0.weight"].ne(weights["0.weight"]).all()


def _optimizer_tensors(run: Run) -> dict[tuple[int, str], torch.Tensor]:
    state = run.opt.optimizer.state_dict()["state"]
    return {(i, key): value for i, entry in state.items() for key, value in entry.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_reload_copies_the_optimizer_state_into_its_live_tensors(saved):
    """A load in the same process (a roll-back) reuses the optimizer's state tensors: no new memory,
    and the values are the saved ones; a fresh optimizer gets copies of its own. Neither keeps the
    checkpoint file mapped (`test_loaded_state_keeps_no_checkpoint_file_mapped`)."""
    run, folder = saved
    before = {key: (t.data_ptr(), t.clone()) for key, t in _optimizer_tensors(run).items()}
    run.acc.load_state(folder)
    after = _optimizer_tensors(run)
    assert {key: t.data_ptr() for key, t in after.items()} == {key: ptr for key, (ptr, _) in before.items()}
    reference = CheckpointReader(folder).read_torch("optimizer.pt")["state"]
    for (i, key), tensor in after.items():
        assert torch.equal(tensor, reference[i][key]), (i, key)
        if key == "exp_avg":
            assert not torch.equal(tensor, before[(i, key)][1])  # two steps past the checkpoint: it changed

    fresh = Run(seed=1)  # no step yet: an optimizer without state
    fresh.acc.load_state(folder)
    for (i, key), tensor in _optimizer_tensors(fresh).items():
        assert torch.equal(tensor, reference[i][key]) and tensor.data_ptr() != after[(i, key)].data_ptr()
    assert mapped_files_under(folder) == []


# ------------------------------------------------------------------ 5. a folder pruned while it is read
@pytest.mark.parametrize("read", ["verify", "read_tensors", "read_torch", "read_json"])
def test_a_folder_renamed_away_mid_read_is_deleted_not_damaged(saved, read):
    _, folder = saved
    reader = CheckpointReader(folder)
    os.rename(folder, folder.parent / f".{folder.name}.deleting")  # what pruning does first
    name = {"verify": None, "read_tensors": "model.safetensors", "read_torch": "optimizer.pt",
            "read_json": "accelerator_state.json"}[read]
    with pytest.raises(CheckpointDeletedError) as info:
        getattr(reader, read)(*([name] if name else []))
    assert "deleted" in str(info.value) and "damaged" not in str(info.value)


def test_a_folder_replaced_under_its_name_mid_read_is_not_damaged(saved):
    run, folder = saved
    reader = CheckpointReader(folder)
    run.acc.save_state(folder)  # a new save into the same folder swaps it for another
    with pytest.raises(CheckpointDeletedError, match="replaced"):
        reader.verify()


PRUNING_SAVES, MAX_LOOKUPS = 20, 200_000


@contextlib.contextmanager
def concurrent_pruner(project: pathlib.Path) -> Iterator[Callable[[], bool]]:
    """Saves with total_limit=1 on another thread, PRUNING_SAVES times; yields "is it still saving?".

    The model is large enough that checking a folder takes longer than the pruner's step from
    committing a new folder to deleting the old one, so a folder being read often vanishes.
    """
    pruner = Run(project=project, total_limit=1, optimizer="sgd", hidden=65536)
    pruner.acc.save_state()
    stop, saved, failures = threading.Event(), [], []

    def prune() -> None:
        try:
            while not stop.is_set() and len(saved) < PRUNING_SAVES:
                saved.append(pruner.acc.save_state())
        except BaseException as err:  # reported by the main thread
            failures.append(err)

    thread = threading.Thread(target=prune, daemon=True)
    thread.start()
    try:
        yield thread.is_alive
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive() and not failures
    assert len(saved) == PRUNING_SAVES


def test_latest_never_calls_a_checkpoint_being_pruned_damaged(tmp_path):
    warned: list[str] = []
    found: list[pathlib.Path] = []
    spans: list[tuple[str, str]] = []  # the newest folder before and after each lookup
    with concurrent_pruner(tmp_path) as saving:
        for _ in range(MAX_LOOKUPS):
            before = _newest(tmp_path)
            found.append(latest_checkpoint(tmp_path / "checkpoints", warned.append))
            spans.append((before, _newest(tmp_path)))
            if not saving():
                break
    assert warned == []
    # The pruner really ran meanwhile (as in the load_state test below).
    assert len({folder.name for folder in found}) > 1 or any(a != b for a, b in spans), (found, spans)


def test_load_state_of_the_newest_survives_a_concurrent_pruner(tmp_path):
    """load_state() chooses again when the folder it chose is pruned before it is read."""
    loader = Run(project=tmp_path, optimizer="sgd", hidden=65536)
    loaded: list[str] = []
    spans: list[tuple[str, str]] = []  # the newest folder before and after each load
    with warnings.catch_warnings(record=True) as caught, concurrent_pruner(tmp_path) as saving:
        warnings.simplefilter("always")
        for _ in range(MAX_LOOKUPS):
            before = _newest(tmp_path)
            loaded.append(pathlib.Path(loader.acc.load_state()).name)
            spans.append((before, _newest(tmp_path)))
            if not saving():
                break
    assert [str(w.message) for w in caught] == []
    # The pruner really ran meanwhile: the loads found several folders, or (on a busy machine, where
    # one load may outlast many saves) a load ran while a save replaced the newest folder.
    assert len(set(loaded)) > 1 or any(before != after for before, after in spans), (loaded, spans)


def _newest(project: pathlib.Path) -> str:
    names = [re.fullmatch(r"checkpoint_(\d+)", f.name) for f in (project / "checkpoints").iterdir()]
    numbers = [int(m[1]) for m in names if m]
    return f"checkpoint_{max(numbers)}"


def test_a_parser_failing_because_the_folder_was_pruned_mid_read_is_a_deletion_not_damage(tmp_path):
    """torch.load reports a file that vanished mid-read with its own RuntimeError, not an OSError;
    once the folder is gone that is a deletion (load_state then picks another), never damage."""
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 1))
    folder = pathlib.Path(acc.save_state(tmp_path / "checkpoint"))
    reader = CheckpointReader(folder)

    def pruned_while_parsing(path: pathlib.Path) -> Any:
        os.rename(folder, tmp_path / ".checkpoint.deleting")  # what pruning does first
        raise RuntimeError(f"Unable to open file <{path}> in read-only mode: No such file or directory (2)")

    with pytest.raises(CheckpointDeletedError, match="was deleted or replaced while it was being read"):
        reader._decode("random_states_0.pt", pruned_while_parsing, "could not be read")
