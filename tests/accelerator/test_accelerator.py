"""The Accelerator facade on one process: facts, unwrapping, saving models, collectives, teardown.

Checkpoints (save_state/load_state) have their own file, tests/checkpoint/test_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fittrain import Accelerator, DistributedType, ProjectConfiguration, Trainer
from support.models import mlp


def linear_dtypes(model: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def as_rank_1_of_2(accelerator: Accelerator) -> None:
    """Makes the accelerator believe it is rank 1 of 2, to observe main-process-only behaviour.

    Only methods that do not communicate may be called afterwards.
    """
    state = dataclasses.replace(accelerator.state, num_processes=2, process_index=1, local_process_index=1)
    # The parts the Accelerator owns hold the same process facts.
    accelerator.state = accelerator.checkpointing.state = accelerator.distributed_strategy.state = state


# ------------------------------------------------------------------ facts
def test_single_process_facts():
    accelerator = Accelerator(cpu=True)
    assert accelerator.device == torch.device("cpu")
    assert accelerator.num_processes == 1 and accelerator.process_index == 0
    assert accelerator.local_process_index == 0
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert accelerator.distributed_type == DistributedType.NO
    assert accelerator.mixed_precision == "no" and accelerator.gradient_accumulation_steps == 1
    assert accelerator.sync_gradients is True and accelerator.optimizer_step_was_skipped is False


def test_device_prefers_cuda_then_mps_then_cpu():
    mps = getattr(torch.backends, "mps", None)
    if torch.cuda.is_available():
        want = "cuda"
    elif mps is not None and mps.is_available():
        want = "mps"
    else:
        want = "cpu"
    assert Accelerator().device.type == want
    assert Accelerator(cpu=True).device.type == "cpu"


def test_project_dir_sets_the_logging_dir(tmp_path):
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    assert accelerator.project_dir == str(tmp_path)
    assert accelerator.logging_dir == str(tmp_path)  # Accelerate's: the project folder itself
    given = ProjectConfiguration(logging_dir=str(tmp_path / "tb"))
    assert Accelerator(cpu=True, project_dir=tmp_path, project_config=given).logging_dir == str(tmp_path / "tb")
    # A ProjectConfiguration alone too (Accelerate's __post_init__), and the Trainer keeps its logs/ folder.
    assert Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path))).logging_dir == str(tmp_path)
    assert Trainer(project_dir=tmp_path).accelerator.logging_dir == str(tmp_path / "logs")
    assert list(tmp_path.iterdir()) == []  # nothing is created until something is written


# ------------------------------------------------------------------ bad constructor arguments
@pytest.mark.parametrize("kwargs, argument, shown", [
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", "0"),
    ({"mixed_precision": "fp7"}, "mixed_precision", "'fp7'"),
    ({"strategy": "zero3"}, "strategy", "'zero3'"),
])
def test_bad_constructor_arguments_name_the_argument_and_value_and_write_nothing(tmp_path, kwargs, argument, shown):
    project = tmp_path / "project"
    with pytest.raises(ValueError) as info:
        Accelerator(cpu=True, project_dir=project, **kwargs)
    message = str(info.value)
    assert f"{argument}={shown}" in message, message
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ unwrap_model
def test_unwrap_model_keeps_or_removes_the_fp32_wrapper():
    reference = mlp()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(mlp())
    x = torch.randn(3, 4)

    kept = accelerator.unwrap_model(model)  # keep_fp32_wrapper=True is the default, as in Accelerate
    assert kept is model and type(kept) is nn.Sequential
    dtypes = linear_dtypes(kept)
    out = kept(x)
    assert dtypes[-1] == torch.bfloat16 and out.dtype == torch.float32

    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain is model
    dtypes.clear()
    out = plain(x)
    # Back to the module's own forward: full precision, the same numbers as an unprepared copy.
    assert dtypes == [torch.float32, torch.float32]
    assert torch.equal(out, reference(x))


def test_unwrap_model_of_a_plain_model_is_the_model():
    accelerator = Accelerator(cpu=True)
    model = mlp()
    assert accelerator.unwrap_model(accelerator.prepare(model)) is model
    assert accelerator.unwrap_model(model, keep_fp32_wrapper=False) is model


# ------------------------------------------------------------------ saving models and objects
def test_save_model_shards_past_max_shard_size(tmp_path):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)))
    accelerator.save_model(model, tmp_path / "out", max_shard_size="1KB")

    names = sorted(os.listdir(tmp_path / "out"))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert "model.safetensors.index.json" in names and "model.safetensors" not in names
    assert len(shards) > 1
    assert all(n.startswith("model-") and f"-of-{len(shards):05d}" in n for n in shards)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    want = model.state_dict()
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(shards)
    # Each shard holds the tensors the index says, and together they rebuild the model exactly.
    merged = {}
    for shard in shards:
        tensors = load_file(tmp_path / "out" / shard)
        assert all(index["weight_map"][k] == shard for k in tensors)
        merged.update(tensors)
    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    fresh.load_state_dict(merged, strict=True)
    assert all(torch.equal(merged[k], v) for k, v in want.items())


def test_save_model_in_one_file_under_the_limit(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(mlp())
    accelerator.save_model(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_save_writes_on_the_main_process_only(tmp_path):
    accelerator = Accelerator(cpu=True)
    obj = {"w": torch.arange(3)}
    accelerator.save(obj, tmp_path / "main.pt")
    assert torch.equal(torch.load(tmp_path / "main.pt", weights_only=True)["w"], obj["w"])
    accelerator.save(obj, tmp_path / "main.safetensors", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "main.safetensors")["w"], obj["w"])

    other = Accelerator(cpu=True)
    model = other.prepare(mlp())
    as_rank_1_of_2(other)
    other.save(obj, tmp_path / "rank1.pt")
    other.save_model(model, tmp_path / "rank1_model")
    assert not (tmp_path / "rank1.pt").exists() and not (tmp_path / "rank1_model").exists()


# ------------------------------------------------------------------ collectives with one process
def test_gather_and_reduce_with_one_process():
    accelerator = Accelerator(cpu=True)
    t = torch.arange(6.0).reshape(3, 2)
    nested = {"a": t, "b": [t[0], (t[1],)]}
    gathered = accelerator.gather(nested)
    assert torch.equal(gathered["a"], t) and torch.equal(gathered["b"][1][0], t[1])
    assert torch.equal(accelerator.reduce(t), t)
    assert torch.equal(accelerator.reduce(t, reduction="mean"), t)
    assert torch.equal(accelerator.reduce(t, scale=2.0), t * 2)
    assert torch.equal(accelerator.reduce(nested)["b"][0], t[0])
    assert torch.equal(accelerator.reduce(t, reduction="max"), t)
    with pytest.raises(ValueError, match="reduction='median'"):
        accelerator.reduce(t, reduction="median")


def test_pad_across_processes_and_split_between_processes_with_one_process():
    accelerator = Accelerator(cpu=True)
    t = torch.arange(5)
    assert torch.equal(accelerator.pad_across_processes(t), t)
    assert torch.equal(accelerator.pad_across_processes({"x": t.reshape(1, 5)}, dim=1)["x"], t.reshape(1, 5))
    for apply_padding in (False, True):
        with accelerator.split_between_processes([1, 2, 3], apply_padding=apply_padding) as share:
            assert share == [1, 2, 3]
        with accelerator.split_between_processes(t, apply_padding=apply_padding) as share:
            assert torch.equal(share, t)
        with accelerator.split_between_processes({"p": ["a", "b"], "q": t}) as share:
            assert share["p"] == ["a", "b"] and torch.equal(share["q"], t)


def test_gather_for_metrics_returns_every_sample_once():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Identity())
    data = torch.arange(10.0).unsqueeze(1)
    loader = accelerator.prepare(DataLoader(TensorDataset(data), batch_size=4))
    collected = [accelerator.gather_for_metrics(model(x)) for (x,) in loader]
    assert torch.equal(torch.cat(collected), data)
    # Python objects go through gather_object and come back as one list.
    names = accelerator.gather_for_metrics(["a", "b"], use_gather_object=True)
    assert names == ["a", "b"]


def test_gather_for_metrics_trims_the_last_short_batch_on_one_process_as_accelerate():
    """A per-batch value repeated per sample (transformers' `loss.repeat(batch_size)` idiom) keeps
    only the last batch's real samples, so the mean weighs every sample once, as in Accelerate."""
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    rows = [accelerator.gather_for_metrics(x.mean().repeat(4)) for (x,) in loader]
    assert [len(r) for r in rows] == [4, 4, 2]
    assert torch.cat(rows).mean() == torch.arange(10.0).mean()
    dropped = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, drop_last=True))
    assert [len(accelerator.gather_for_metrics(x.repeat(2))) for (x,) in dropped] == [8, 8]  # no short batch


def test_main_process_first_runs_the_block_and_propagates_errors():
    accelerator = Accelerator(cpu=True)
    ran = []
    with accelerator.main_process_first():
        ran.append("main")
    with accelerator.local_main_process_first():
        ran.append("local")
    assert ran == ["main", "local"]
    with pytest.raises(KeyError):
        with accelerator.main_process_first():
            raise KeyError("boom")
    accelerator.wait_for_everyone()  # a no-op barrier with one process


def test_print_only_on_the_local_main_process(capsys):
    accelerator = Accelerator(cpu=True)
    accelerator.print("loss", 1.5, sep="=", end="!\n")
    assert capsys.readouterr().out == "loss=1.5!\n"
    as_rank_1_of_2(accelerator)
    accelerator.print("hidden")
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ teardown
def test_free_memory_forgets_prepared_objects(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(TensorDataset(torch.ones(4, 4))))
    alive = weakref.ref(model)
    model, optimizer, loader = accelerator.free_memory(model, optimizer, loader)
    assert (model, optimizer, loader) == (None, None, None)
    assert alive() is None  # the accelerator no longer keeps the model alive
    # A later checkpoint holds none of the freed objects, and new objects can be prepared.
    accelerator.save_state(tmp_path / "ckpt")
    assert not any(n.startswith(("model", "optimizer")) for n in os.listdir(tmp_path / "ckpt"))
    again = accelerator.prepare(mlp())
    assert accelerator.unwrap_model(again) is again
    assert accelerator.clear() == []


def test_end_training_is_safe_with_one_process():
    accelerator = Accelerator(cpu=True)
    accelerator.end_training()
    accelerator.end_training()
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


@pytest.mark.parametrize("kwargs, named", [({"project_config": "outputs"}, "project_config='outputs'"),
                                           ({"project_dir": 123}, "project_dir=123")])
def test_a_project_argument_of_the_wrong_type_is_named_at_construction(kwargs: dict, named: str) -> None:
    with pytest.raises(TypeError) as raised:
        Accelerator(**kwargs)
    assert named in str(raised.value)
    assert "ProjectConfiguration" in str(raised.value) or "os.PathLike" in str(raised.value)


@pytest.mark.parametrize("classes, shown", [(5, "fsdp_classes=5"), ("Linear", "fsdp_classes='Linear'"),
                                            ([torch.nn.Linear, 5], "fsdp_classes=[<class"),
                                            ([torch.nn.Linear(2, 2)], "fsdp_classes=[Linear(")])
def test_fsdp_classes_are_checked_when_the_accelerator_is_built(classes, shown):
    with pytest.raises(TypeError, match=r"`fsdp_classes` must be nn\.Module subclasses.*Received: " + re.escape(shown)
                       + r".*fsdp_classes=\[MyBlock\]"):
        Accelerator(cpu=True, fsdp_classes=classes)


def test_fsdp_classes_take_a_list_or_one_class():
    assert Accelerator(cpu=True, fsdp_classes=[torch.nn.Linear]).fsdp_classes == (torch.nn.Linear,)
    assert Accelerator(cpu=True, fsdp_classes=torch.nn.Linear).fsdp_classes == (torch.nn.Linear,)
    assert Accelerator(cpu=True, fsdp_classes=None).fsdp_classes is None
