"""save_state(async_save=True): a snapshot taken on the calling thread, written by a real background thread.

Each test that needs the write to be still in flight at a given moment holds it with a gate: the
writer of our own code (`fittrain.checkpoint.snapshot.write_snapshot`) is wrapped so that it waits for an
event before writing anything. Nothing of torch is mocked.
"""

from __future__ import annotations

import json
import pathlib
import threading
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, ProjectConfiguration
from fittrain.checkpoint import CheckpointReader, latest_checkpoint
from fittrain.checkpoint import snapshot as snapshot_module


class History:
    """A registered object whose state holds a list that training appends to in place."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"losses": self.losses}  # the live list: a snapshot must copy it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])


class Run:
    """A prepared model, AdamW, StepLR, loader and registered object, on the CPU, under fp16 (so a
    scaler is saved too)."""

    def __init__(self, project: pathlib.Path | None = None, total_limit: int | None = None) -> None:
        torch.manual_seed(0)
        config = ProjectConfiguration(project, automatic_checkpoint_naming=project is not None,
                                      total_limit=total_limit)
        self.acc = Accelerator(cpu=True, mixed_precision="fp16", project_config=config)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        x = torch.randn(64, 4)
        loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
        self.model, self.opt, self.sched, self.loader = self.acc.prepare(model, optimizer, scheduler, loader)
        self.history = History()
        self.acc.register_for_checkpointing(self.history)
        self.batches = iter(self.loader)

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            inputs, targets = next(self.batches)
            loss = nn.functional.mse_loss(self.model(inputs), targets)
            self.acc.backward(loss)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.history.losses.append(loss.item())

    def state(self) -> dict[str, Any]:
        """Copies of everything a checkpoint restores, to compare before and after."""
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "exp_avg": [s["exp_avg"].clone() for s in self.opt.state_dict()["state"].values()],
                "lr": self.sched.get_last_lr(), "losses": list(self.history.losses),
                "position": self.loader.state_dict(), "rng": torch.get_rng_state()}

    def mutate(self) -> None:
        """What training does to the live objects right after a save, all of it in place: an
        optimizer step changes the parameters and the optimizer's state (the only in-place change
        to them that an async save allows before its copy is made: the step waits for it)."""
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)
        self.opt.step()
        self.history.losses.append(123.0)
        self.sched.step()
        torch.rand(3)  # moves the RNG


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["model"].keys() == expected["model"].keys()
    for key in expected["model"]:
        assert torch.equal(actual["model"][key], expected["model"][key]), key
    assert all(torch.equal(a, e) for a, e in zip(actual["exp_avg"], expected["exp_avg"], strict=True))
    assert actual["lr"] == expected["lr"] and actual["losses"] == expected["losses"]
    torch.testing.assert_close(actual["position"], expected["position"], rtol=0, atol=0)  # holds RNG tensors
    assert torch.equal(actual["rng"], expected["rng"])


class Gate(threading.Event):
    """Set it to let writes through; `reached` is set once a write waits at it."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = threading.Event()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Holds every write (sync ones too) inside its temporary folder, before its first file,
    until the gate is set."""
    event = Gate()
    original = snapshot_module.write_snapshot

    def gated(writer, snapshot):  # type: ignore[no-untyped-def]
        event.reached.set()
        if not event.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        original(writer, snapshot)

    monkeypatch.setattr(snapshot_module, "write_snapshot", gated)
    yield event
    event.set()  # never leave a writer thread blocked behind a failed test


def _hidden_entries(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_async_save_writes_the_same_files_as_a_sync_save(tmp_path):
    run = Run()
    run.train(3)
    run.acc.save_state(tmp_path / "sync")
    returned = run.acc.save_state(tmp_path / "async", async_save=True)
    assert returned == str(tmp_path / "async")
    run.acc.wait_for_checkpoint()
    sync, background = CheckpointReader(tmp_path / "sync"), CheckpointReader(tmp_path / "async")
    assert background.names() == sync.names()
    assert "scaler.pt" in sync.names() and "custom_checkpoint_0.pt" in sync.names()
    for name in [*sync.names(), "manifest.json"]:  # manifests equal: same sizes and CRC32s
        assert (tmp_path / "async" / name).read_bytes() == (tmp_path / "sync" / name).read_bytes(), name


def test_training_after_the_call_does_not_leak_into_the_checkpoint(tmp_path, gate):
    run = Run()
    run.train(3)
    before = run.state()
    run.acc.save_state(tmp_path / "ckpt", async_save=True)
    run.mutate()  # the write has not started: only the snapshot holds the state now
    gate.set()
    run.acc.wait_for_checkpoint()
    assert run.state()["losses"] != before["losses"]
    run.acc.load_state(tmp_path / "ckpt")
    _assert_same_state(run.state(), before)


@pytest.fixture
def held_copy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    """Holds the writing thread before it copies the parameters and optimizer state that an async
    save copies there (`BackgroundCheckpoints.fill`), until the gate is set."""
    from fittrain.checkpoint.background import BackgroundCheckpoints

    event, original = Gate(), BackgroundCheckpoints.fill

    def held(self):  # type: ignore[no-untyped-def]
        event.reached.set()
        if not event.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")
        original(self)

    monkeypatch.setattr(BackgroundCheckpoints, "fill", held)
    yield event
    event.set()


def test_the_next_optimizer_step_waits_for_the_background_copy(tmp_path, held_copy):
    run = Run()
    run.train(3)
    before = run.state()
    run.acc.save_state(tmp_path / "ckpt", async_save=True)
    assert held_copy.reached.wait(timeout=60)
    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (run.mutate(), stepped.set()))
    stepper.start()
    # The step waits while the copy is held (however long: nothing here depends on how long).
    assert not stepped.wait(timeout=0.5)
    held_copy.set()
    stepper.join(timeout=60)
    assert stepped.is_set()
    run.acc.wait_for_checkpoint()  # no error: nothing changed before the copy
    run.acc.load_state(tmp_path / "ckpt")
    _assert_same_state(run.state(), before)


def test_a_parameter_changed_in_place_before_the_copy_fails_the_save_by_name(tmp_path, held_copy):
    run = Run()
    run.train(2)
    run.acc.save_state(tmp_path / "ckpt", async_save=True)
    assert held_copy.reached.wait(timeout=60)
    with torch.no_grad():
        next(run.model.parameters()).mul_(2.0)  # not an optimizer step: nothing waits for the copy
    held_copy.set()
    with pytest.raises(RuntimeError, match=r"1 parameter or optimizer-state tensor\(s\) were changed in place "
                                           r"after save_state\(async_save=True\) returned"):
        run.acc.wait_for_checkpoint()
    assert not (tmp_path / "ckpt").exists() and _hidden_entries(tmp_path) == []
    run.acc.save_state(tmp_path / "again", async_save=True)  # the next save is unaffected
    run.acc.wait_for_checkpoint()
    assert (tmp_path / "again" / "manifest.json").exists()


def test_a_buffer_that_forward_passes_update_is_copied_at_the_call(tmp_path, held_copy):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model, optimizer = acc.prepare(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
                                   torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    model(torch.randn(8, 4))
    at_call = model[1].running_mean.clone()
    acc.save_state(tmp_path / "ckpt", async_save=True)
    assert held_copy.reached.wait(timeout=60)
    model(torch.randn(8, 4) + 5)  # updates running_mean in place: allowed, it was copied at the call
    assert not torch.equal(model[1].running_mean, at_call)
    held_copy.set()
    acc.wait_for_checkpoint()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(model[1].running_mean, at_call)


def test_the_folder_appears_only_when_the_write_is_complete(tmp_path, gate):
    run = Run(tmp_path, total_limit=1)
    run.train()
    gate.set()
    first = pathlib.Path(run.acc.save_state())
    gate.clear()
    gate.reached.clear()
    run.train()
    pending = pathlib.Path(run.acc.save_state(async_save=True))
    assert pending.name == "checkpoint_1"
    assert gate.reached.wait(timeout=60)
    # While it is written: hidden under a temporary name, ignored by "latest", and the older
    # checkpoint is not pruned yet, so a complete one exists at every moment.
    assert not pending.exists() and _hidden_entries(pending.parent) == [".checkpoint_1.tmp"]
    assert latest_checkpoint(pending.parent, pytest.fail) == first
    gate.set()
    run.acc.wait_for_checkpoint()
    assert [p.name for p in pending.parent.iterdir()] == ["checkpoint_1"]  # committed, then pruned
    CheckpointReader(pending).verify()


def test_numbering_and_total_limit_over_several_async_saves(tmp_path):
    run = Run(tmp_path, total_limit=2)
    expected = {}
    for i in range(4):
        run.train()
        path = run.acc.save_state(async_save=True)  # waits for the previous one first
        assert path == str(tmp_path / "checkpoints" / f"checkpoint_{i}")
        expected[i] = run.state()
    run.acc.wait_for_checkpoint()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_2", "checkpoint_3"]
    run.train()
    assert run.acc.load_state() == str(folder / "checkpoint_3")
    _assert_same_state(run.state(), expected[3])
    run.acc.load_state(folder / "checkpoint_2")
    _assert_same_state(run.state(), expected[2])
    assert run.acc.save_state() == str(folder / "checkpoint_4")  # numbering goes on after a load


def test_load_state_waits_for_the_write_in_flight(tmp_path, gate):
    run = Run(tmp_path)
    run.train(2)
    before = run.state()
    run.acc.save_state(async_save=True)
    run.mutate()
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    # Without waiting, "latest" would find no checkpoint at all: it is still being written.
    assert run.acc.load_state() == str(tmp_path / "checkpoints" / "checkpoint_0")
    opener.join()
    _assert_same_state(run.state(), before)


def _failing_writer(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Makes every write fail after its first file, as a full disk would; returns the real writer."""
    original = snapshot_module.write_snapshot

    def failing(writer, snapshot):  # type: ignore[no-untyped-def]
        writer.write_json("partial.json", {"written": True})
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_module, "write_snapshot", failing)
    return original


def _notes(err: BaseException) -> str:
    return "\n".join(getattr(err, "__notes__", []))


def test_a_failed_background_write_surfaces_at_wait_for_checkpoint(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.train()
    original = _failing_writer(monkeypatch)
    path = pathlib.Path(run.acc.save_state(async_save=True))
    with pytest.raises(OSError, match="No space left") as caught:
        run.acc.wait_for_checkpoint()
    assert f"background checkpoint write to {path}" in _notes(caught.value)
    assert not path.exists()
    assert set(_hidden_entries(path.parent)) <= {".checkpoint_0.tmp"}  # nothing that looks complete
    run.acc.wait_for_checkpoint()  # raised once; nothing is pending any more

    monkeypatch.setattr(snapshot_module, "write_snapshot", original)
    retried = run.acc.save_state(async_save=True)
    run.acc.wait_for_checkpoint()
    assert retried == str(tmp_path / "checkpoints" / "checkpoint_1")  # the failed one's number stays used
    CheckpointReader(retried).verify()


@pytest.mark.parametrize("next_call", ["save_state", "async save_state", "load_state", "end_training"])
def test_a_failed_background_write_surfaces_at_the_next_call(tmp_path, monkeypatch, next_call):
    run = Run(tmp_path)
    run.train()
    run.acc.save_state(tmp_path / "good")
    _failing_writer(monkeypatch)
    path = run.acc.save_state(tmp_path / "bad", async_save=True)
    calls = {"save_state": lambda: run.acc.save_state(tmp_path / "next"),
             "async save_state": lambda: run.acc.save_state(tmp_path / "next", async_save=True),
             "load_state": lambda: run.acc.load_state(tmp_path / "good"),
             "end_training": run.acc.end_training}
    with pytest.raises(OSError, match="No space left") as caught:
        calls[next_call]()
    assert f"background checkpoint write to {path}" in _notes(caught.value)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "next").exists()


def test_a_sync_save_after_an_async_one_waits_and_both_land(tmp_path, gate):
    run = Run()
    run.train()
    first = run.state()
    run.acc.save_state(tmp_path / "a", async_save=True)
    run.train()
    second = run.state()
    threading.Timer(0.2, gate.set).start()
    run.acc.save_state(tmp_path / "b")  # waits for "a" (its gate opens later), then writes
    assert CheckpointReader(tmp_path / "a").names() == CheckpointReader(tmp_path / "b").names()
    run.acc.load_state(tmp_path / "a")
    _assert_same_state(run.state(), first)
    run.acc.load_state(tmp_path / "b")
    _assert_same_state(run.state(), second)


def test_the_accelerator_state_is_captured_at_the_call(tmp_path, gate):
    run = Run()
    run.train(2)
    position = run.loader.state_dict()
    run.acc.save_state(tmp_path / "ckpt", async_save=True)
    run.train(2)  # moves the data position on
    gate.set()
    run.acc.wait_for_checkpoint()
    meta = json.loads((tmp_path / "ckpt" / "accelerator_state.json").read_text())
    fields = {key: position[key] for key in ("seed", "epoch", "batches_consumed", "order_consumed")}
    assert meta["dataloaders"] == [fields] and position["batches_consumed"] == 2
    saved = torch.load(tmp_path / "ckpt" / "data_states_0.pt", weights_only=True)
    torch.testing.assert_close(saved, [position], rtol=0, atol=0)


def test_staging_buffers_copy_a_state_and_reuse_their_memory_for_the_next_snapshot():
    from collections import OrderedDict, namedtuple

    from fittrain.checkpoint.background import StagingBuffers

    Pair = namedtuple("Pair", "a b")
    live = {"model": OrderedDict(w=torch.randn(3, 4), b=torch.randn(4)), "pair": Pair(torch.ones(2), [1, "x"]),
            "step": torch.tensor(3.0), "betas": (0.9, 0.999)}
    buffers = StagingBuffers()
    buffers.reset()
    first = buffers.copy(live)
    assert type(first["model"]) is OrderedDict and list(first["model"]) == ["w", "b"]
    assert type(first["pair"]) is Pair and first["pair"].b == [1, "x"] and first["pair"].b is not live["pair"].b
    assert first["betas"] == (0.9, 0.999)
    live["model"]["w"].add_(1.0)  # in place, as an optimizer step does
    assert not torch.equal(first["model"]["w"], live["model"]["w"])

    buffers.reset()  # the first snapshot is written: its memory is free again
    live["model"]["b"] = torch.randn(5)  # a new shape cannot reuse the old buffer
    second = buffers.copy(live)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert second["step"].data_ptr() == first["step"].data_ptr()
    assert second["model"]["b"].data_ptr() != first["model"]["b"].data_ptr()
    for key in ("w", "b"):
        assert torch.equal(second["model"][key], live["model"][key])


def test_free_memory_waits_for_the_write_and_lets_the_next_save_allocate_anew(tmp_path, gate):
    run = Run()
    run.train()
    run.acc.save_state(tmp_path / "a", async_save=True)
    threading.Timer(0.2, gate.set).start()
    run.acc.free_memory()  # waits: the folder is complete when it returns
    CheckpointReader(tmp_path / "a").verify()
    kept = run.acc.checkpointing.background._buffers
    assert kept._taken == [] and kept._free == []  # nothing of the copy is held any more


_EXITS_DURING_A_WRITE = """
import sys, time
import torch
from fittrain import Accelerator, ProjectConfiguration
from fittrain.checkpoint import snapshot

write = snapshot.write_snapshot
def slow_write(*args):  # the write is surely still running when the script ends
    time.sleep(1.0)
    write(*args)
snapshot.write_snapshot = slow_write

accelerator = Accelerator(project_config=ProjectConfiguration(sys.argv[1], automatic_checkpoint_naming=True))
model, optimizer = accelerator.prepare(torch.nn.Linear(4, 4), None)
print(accelerator.save_state(async_save=True))
if sys.argv[2] == "raise":
    raise RuntimeError("the script fails after starting the save")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("ending", ["normal", "raise"])
def test_a_one_process_script_that_ends_during_an_async_write_still_lands_it(tmp_path, ending):
    import subprocess
    import sys

    from fittrain.checkpoint import is_intact

    done = subprocess.run([sys.executable, "-c", _EXITS_DURING_A_WRITE, str(tmp_path), ending],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if ending == "normal" else 1), done.stderr[-3000:]
    assert is_intact(tmp_path / "checkpoints" / "checkpoint_0"), (done.stdout, done.stderr[-3000:])
