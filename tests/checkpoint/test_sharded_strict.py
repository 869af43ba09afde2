"""A sharded checkpoint is checked as strictly as a full one, before anything is applied (issue 23, part 1).

On one process (DCP without a process group, as tests/checkpoint/test_sharded_checkpoint.py): optimizer
parameter groups that differ from the run's, a hostile `shards/values.pt`, and data positions past
the end of the loader (`data_states_{rank}.pt`, both formats) are refused naming the file, with
every live object unchanged, and `load_state()` passes over a damaged newest checkpoint to the one
before. Bad arguments to `load_state`, `save_state` and `skip_first_batches` are refused at the call.
tests/checkpoint/test_sharded_strict_fsdp.py runs the same refusals under FSDP2 on 2 processes.
"""

from __future__ import annotations

import copy
import io
import json
import pathlib
import re
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, ProjectConfiguration
from fittrain.checkpoint import CheckpointError, CheckpointMismatchError
from fittrain.checkpoint.crc import file_checksum


class Run:
    """A small model, optimizer, StepLR schedule and 8-batch loader, prepared by one Accelerator."""

    def __init__(self, project: pathlib.Path | None = None, state_dict_type: str = "sharded", groups: int = 1,
                 optimizer: type = torch.optim.AdamW, width: int = 8) -> None:
        config = ProjectConfiguration(project, automatic_checkpoint_naming=True) if project else None
        self.accelerator = Accelerator(state_dict_type=state_dict_type, project_config=config)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
        params: Any = model.parameters()
        if groups == 2:
            params = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}]
        opt = optimizer(params, lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        data = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)  # 8 batches an epoch
        self.model, self.opt, self.sched, self.data = self.accelerator.prepare(model, opt, sched, data)

    def train(self, steps: int) -> None:
        for _, (x,) in zip(range(steps), self.data):
            self.accelerator.backward(self.model(x).pow(2).mean())
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()

    def snapshot(self) -> dict[str, Any]:
        """Everything a load may change, copied."""
        return {"weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": copy.deepcopy(self.opt.state_dict()), "scheduler": self.sched.state_dict(),
                "data": self.data.state_dict(), "rng": torch.get_rng_state()}

    def assert_unchanged(self, before: dict[str, Any]) -> None:
        after = self.snapshot()
        assert after["weights"].keys() == before["weights"].keys()
        assert all(torch.equal(after["weights"][k], v) for k, v in before["weights"].items())
        assert _plain(after["optimizer"]) == _plain(before["optimizer"])
        assert after["scheduler"] == before["scheduler"]
        assert _plain(after["data"]) == _plain(before["data"])
        assert torch.equal(after["rng"], before["rng"])


def _plain(tree: Any) -> Any:
    """A state with its tensors as lists, comparable with ==."""
    if isinstance(tree, torch.Tensor):
        return tree.tolist()
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


def _rewrite_torch(folder: pathlib.Path, name: str, change: Callable[[Any], None]) -> None:
    """Changes a weights_only torch file and fixes its manifest entry, as an attacker who knows the format would."""
    obj = torch.load(folder / name, weights_only=True)
    change(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    (folder / name).write_bytes(buffer.getvalue())
    manifest = json.loads((folder / "manifest.json").read_text())
    size, crc = file_checksum(folder / name)
    manifest["files"][name] = {"size": size, "crc32": crc}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _saved(tmp_path: pathlib.Path, **kwargs: Any) -> pathlib.Path:
    run = Run(**kwargs)
    run.train(3)
    return pathlib.Path(run.accelerator.save_state(tmp_path / "ckpt"))


# --- parameter groups --------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer, saved_groups, live_groups", [
    (torch.optim.AdamW, 1, 2), (torch.optim.SGD, 1, 2), (torch.optim.AdamW, 2, 1)])
def test_other_parameter_groups_are_refused_as_the_full_format_refuses_them(
        tmp_path: pathlib.Path, optimizer: type, saved_groups: int, live_groups: int) -> None:
    messages = []
    for state_dict_type in ("full", "sharded"):
        folder = _saved(tmp_path / state_dict_type, state_dict_type=state_dict_type, optimizer=optimizer,
                        groups=saved_groups)
        run = Run(state_dict_type=state_dict_type, optimizer=optimizer, groups=live_groups)
        run.train(1)
        before = run.snapshot()
        with pytest.raises(CheckpointMismatchError, match="parameter groups of sizes") as info:
            run.accelerator.load_state(folder)
        run.assert_unchanged(before)
        messages.append(str(info.value))
    assert "optimizer.pt" in messages[0] and "shards/values.pt" in messages[1], messages
    # The same check made both refusals: they say the same but for the file named.
    said = [re.search(r"parameter groups of sizes .*", message).group(0) for message in messages]
    assert said[0] == said[1], messages


def test_a_sharded_checkpoint_into_the_same_groups_still_loads_bitwise(tmp_path: pathlib.Path) -> None:
    folder = _saved(tmp_path, groups=2)
    reference = Run(groups=2)
    reference.train(3)
    reference.train(2)
    run = Run(groups=2)
    run.accelerator.load_state(folder)
    run.train(2)
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in reference.model.state_dict().items())


# --- values.pt ---------------------------------------------------------------------------------

def _group(values: dict[str, Any]) -> dict[str, Any]:
    return values["optimizer_0"]["param_groups"][0]


HOSTILE_VALUES = {
    "garbage state": lambda v: v["optimizer_0"].__setitem__("state", "garbage"),
    "lr='evil'": lambda v: _group(v).__setitem__("lr", "evil"),
    "betas='xx'": lambda v: _group(v).__setitem__("betas", "xx"),
    "param_groups=[]": lambda v: v["optimizer_0"].__setitem__("param_groups", []),
    "per-parameter state a string": lambda v: v["optimizer_0"]["state"].__setitem__("0.weight", "x"),
    "a value where a tensor was saved": lambda v: v["optimizer_0"]["state"]["0.weight"].__setitem__("step", "x"),
    "state of an unknown parameter": lambda v: v["optimizer_0"]["state"].__setitem__("9.weight", {}),
    "a model entry that is not a dict": lambda v: v.__setitem__("model_0", [1, 2]),
    "a model value where a tensor was saved": lambda v: v["model_0"].__setitem__("0.weight", 3),
}


@pytest.mark.parametrize("change", list(HOSTILE_VALUES), ids=list(HOSTILE_VALUES))
def test_a_hostile_values_file_is_refused_naming_it_before_anything_is_applied(
        tmp_path: pathlib.Path, change: str) -> None:
    folder = _saved(tmp_path)
    _rewrite_torch(folder, "shards/values.pt", HOSTILE_VALUES[change])
    run = Run()
    run.train(1)
    before = run.snapshot()
    with pytest.raises(CheckpointError, match=r"shards/values\.pt") as info:
        run.accelerator.load_state(folder)
    assert not isinstance(info.value, CheckpointMismatchError), info.value  # damage: "latest" passes over it
    assert "\n" not in str(info.value)
    run.assert_unchanged(before)


@pytest.mark.parametrize("key, value", [("lr", "evil"), ("betas", "xx"), ("amsgrad", 1)])
def test_the_full_format_refuses_hyperparameters_of_another_kind_too(tmp_path: pathlib.Path, key: str,
                                                                     value: Any) -> None:
    folder = _saved(tmp_path, state_dict_type="full")
    _rewrite_torch(folder, "optimizer.pt", lambda state: state["param_groups"][0].__setitem__(key, value))
    run = Run(state_dict_type="full")
    before = run.snapshot()
    with pytest.raises(CheckpointError, match=rf"optimizer\.pt' holds parameter group 0 with {key}=") as info:
        run.accelerator.load_state(folder)
    assert not isinstance(info.value, CheckpointMismatchError)
    run.assert_unchanged(before)


def test_restoring_only_the_weights_checks_the_models_values_too(tmp_path: pathlib.Path) -> None:
    """`Checkpointer(restore_best=True)` loads only a model's weights (`Checkpointing.restore_weights`)."""
    folder = _saved(tmp_path)
    _rewrite_torch(folder, "shards/values.pt", HOSTILE_VALUES["a model entry that is not a dict"])
    run = Run()
    before = run.snapshot()
    with pytest.raises(CheckpointError, match=r"values\.pt' holds at 'model_0'"):
        run.accelerator.checkpointing.restore_weights(folder, run.model)
    run.assert_unchanged(before)


def test_a_fresh_optimizer_keeps_no_state_after_a_refused_sharded_load(tmp_path: pathlib.Path) -> None:
    """Describing the live optimizer's sharded state makes DCP create it (a zero-lr step); a refused
    load must not leave that behind, or the first real step would count as the second."""
    folder = _saved(tmp_path)
    _rewrite_torch(folder, "shards/values.pt", HOSTILE_VALUES["lr='evil'"])
    run = Run()
    with pytest.raises(CheckpointError):
        run.accelerator.load_state(folder)
    assert not run.opt.state_dict()["state"]
    assert all(p.grad is None for p in run.model.parameters())


def test_another_model_is_refused_before_the_schedule_or_the_data_position_changes(tmp_path: pathlib.Path) -> None:
    folder = _saved(tmp_path)
    run = Run(width=16)
    run.train(1)
    before = run.snapshot()
    with pytest.raises(CheckpointMismatchError, match=r"'model_0/0\.weight'"):
        run.accelerator.load_state(folder)
    run.assert_unchanged(before)


# --- data_states -------------------------------------------------------------------------------

@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@pytest.mark.parametrize("field", ["batches_consumed", "order_consumed", "start_items"])
def test_a_data_position_past_the_loaders_end_is_refused_naming_the_file(
        tmp_path: pathlib.Path, state_dict_type: str, field: str) -> None:
    folder = _saved(tmp_path, state_dict_type=state_dict_type)
    _rewrite_torch(folder, "data_states_0.pt", lambda states: states[0].__setitem__(field, 10**9))
    run = Run(state_dict_type=state_dict_type)
    run.train(1)
    before = run.snapshot()
    with pytest.raises(CheckpointError, match=rf"data_states_0\.pt.*{field}=1000000000") as info:
        run.accelerator.load_state(folder)
    assert not isinstance(info.value, CheckpointMismatchError), info.value
    run.assert_unchanged(before)


def test_the_last_position_of_an_epoch_still_loads(tmp_path: pathlib.Path) -> None:
    run = Run(state_dict_type="full")
    run.train(8)  # the whole epoch but for the pass's end: batches_consumed 8 of 8
    folder = pathlib.Path(run.accelerator.save_state(tmp_path / "ckpt"))
    assert torch.load(folder / "data_states_0.pt", weights_only=True)[0]["batches_consumed"] in (0, 8)
    _rewrite_torch(folder, "data_states_0.pt", lambda states: states[0].update(batches_consumed=8, order_consumed=32))
    fresh = Run(state_dict_type="full")
    fresh.accelerator.load_state(folder)
    assert fresh.data.position.batches_consumed == 8


def test_a_prepared_loader_refuses_a_position_past_its_end_itself() -> None:
    run = Run(state_dict_type="full")
    state = dict(run.data.state_dict(), batches_consumed=9)
    with pytest.raises(ValueError, match=r"batches_consumed=9.*8 batches"):
        run.data.load_state_dict(state)


# --- "latest" passes over every refusal of damage ----------------------------------------------

@pytest.mark.parametrize("name, change", [
    ("shards/values.pt", HOSTILE_VALUES["lr='evil'"]),
    ("data_states_0.pt", lambda states: states[0].__setitem__("batches_consumed", 10**9)),
])
def test_load_state_passes_over_a_damaged_newest_sharded_checkpoint(
        tmp_path: pathlib.Path, name: str, change: Callable[[Any], None]) -> None:
    run = Run(project=tmp_path)
    run.train(2)
    older = pathlib.Path(run.accelerator.save_state())
    expected = run.snapshot()
    run.train(2)
    newest = pathlib.Path(run.accelerator.save_state())
    _rewrite_torch(newest, name, change)
    fresh = Run(project=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pathlib.Path(fresh.accelerator.load_state()) == older
    assert any(name in str(w.message) and "Skipping checkpoint" in str(w.message) for w in caught)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in expected["weights"].items())


# --- bad arguments -----------------------------------------------------------------------------

def _one_line(info: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("value", [5, 1.5, ["ckpt"]])
def test_load_state_refuses_a_folder_that_is_not_a_path(value: Any) -> None:
    with pytest.raises(TypeError) as info:
        Accelerator().load_state(value)
    _one_line(info, "load_state(input_dir=...)", f"input_dir={value!r}", "path")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_save_state_refuses_an_async_save_that_is_not_a_bool(tmp_path: pathlib.Path, value: Any) -> None:
    with pytest.raises(TypeError) as info:
        Accelerator().save_state(tmp_path / "ckpt", async_save=value)
    _one_line(info, "save_state(async_save=...)", f"async_save={value!r}", "True or False")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("value", [-1, "3", 1.5, True])
def test_skip_first_batches_of_a_prepared_loader_refuses_a_bad_count(value: Any) -> None:
    run = Run(state_dict_type="full")
    expected = ValueError if value == -1 else TypeError
    for call in (lambda: run.accelerator.skip_first_batches(run.data, value),
                 lambda: run.accelerator.skip_first_batches(run.accelerator.skip_first_batches(run.data, 1), value)):
        with pytest.raises(expected) as info:
            call()
        _one_line(info, "num_batches", f"num_batches={value!r}")
