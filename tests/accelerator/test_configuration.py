"""Accelerate's configuration objects on the Accelerator: DataLoaderConfiguration,
GradientAccumulationPlugin, the kwargs handlers and rng_types, on one process.

Their 2-process effects (DDP arguments, communication hooks, the process-group timeout, Join,
trigger_sync_in_backward, sync_each_batch) are in tests/accelerator/test_configuration_ddp.py.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fittrain import Accelerator
from fittrain.accelerator.configuration import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)


def _orders(acc: Accelerator, loader: DataLoader, epochs: int) -> list[list[int]]:
    prepared = acc.prepare(loader)
    return [[i for batch in prepared for i in batch.tolist()] for _ in range(epochs)]


def test_seedable_sampler_orders_follow_data_seed_and_epoch_not_the_global_rng() -> None:
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    acc = Accelerator(cpu=True, dataloader_config=config)
    assert acc.use_seedable_sampler and acc.dataloader_config is config
    orders = _orders(acc, DataLoader(list(range(10)), batch_size=4, shuffle=True), 2)
    expected = [torch.randperm(10, generator=torch.Generator().manual_seed(7 + epoch)).tolist() for epoch in (0, 1)]
    assert orders == expected
    torch.rand(5)  # the global RNG moves on; the next Accelerator's order does not depend on it
    again = _orders(Accelerator(cpu=True, dataloader_config=config), DataLoader(list(range(10)), batch_size=4,
                                                                                shuffle=True), 2)
    assert again == expected


def test_the_default_keeps_the_loaders_own_order() -> None:
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=generator)
    plain = [i for b in loader for i in b.tolist()]
    prepared = _orders(Accelerator(cpu=True), DataLoader(list(range(10)), batch_size=4, shuffle=True,
                                                         generator=torch.Generator().manual_seed(3)), 1)
    assert prepared == [plain]


def test_a_seedable_epoch_resumes_mid_way_with_the_same_order() -> None:
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11)
    acc = Accelerator(cpu=True, dataloader_config=config)
    loader = acc.prepare(DataLoader(list(range(12)), batch_size=3, shuffle=True))
    first = [b.tolist() for b in loader]
    iterator = iter(loader)
    second_head = [next(iterator).tolist()]
    state = loader.state_dict()
    resumed_acc = Accelerator(cpu=True, dataloader_config=config)
    resumed = resumed_acc.prepare(DataLoader(list(range(12)), batch_size=3, shuffle=True))
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed_acc.skip_first_batches(resumed, resumed.position.batches_consumed)]
    assert second_head + rest == _orders_of_epoch(11, 1, 12, 3)
    assert first == _orders_of_epoch(11, 0, 12, 3)


def _orders_of_epoch(seed: int, epoch: int, n: int, batch: int) -> list[list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [order[i:i + batch] for i in range(0, n, batch)]


def test_dataloader_configuration_sets_the_loader_options_and_refuses_conflicts() -> None:
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False, non_blocking=True))
    assert (acc.even_batches, acc.split_batches, acc.non_blocking) == (False, False, True)
    assert acc.prepare(DataLoader(list(range(4)), batch_size=2))._non_blocking
    with pytest.raises(ValueError, match="`even_batches` is given twice"):
        Accelerator(cpu=True, even_batches=False, dataloader_config=DataLoaderConfiguration(even_batches=True))
    with pytest.raises(ValueError, match="dispatch_batches=True"):
        DataLoaderConfiguration(dispatch_batches=True)
    with pytest.raises(TypeError, match=r"`DataLoaderConfiguration\(data_seed=...\)` must be a int. Received: "
                                        r"data_seed='7'"):
        DataLoaderConfiguration(data_seed="7")
    with pytest.raises(TypeError, match="`dataloader_config` must be a fittrain.utils.DataLoaderConfiguration"):
        Accelerator(cpu=True, dataloader_config={"even_batches": False})


def _window_flags(acc: Accelerator, batches: int, passes: int = 1) -> list[bool]:
    model = nn.Linear(2, 1)
    loader = acc.prepare(DataLoader(torch.ones(batches, 2), batch_size=1))
    flags = []
    for _ in range(passes):
        for _batch in loader:
            with acc.accumulate(model):
                flags.append(acc.sync_gradients)
    return flags


def test_gradient_accumulation_plugin_sets_the_window_and_its_end() -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert acc.gradient_accumulation_steps == 2
    assert _window_flags(acc, 3) == [False, True, True]  # the loader's end closes the window
    carried = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=2, sync_with_dataloader=False))
    assert _window_flags(carried, 3, passes=2) == [False, True, False, True, False, True]
    with pytest.raises(ValueError, match="either `gradient_accumulation_steps` or `gradient_accumulation_plugin`"):
        Accelerator(cpu=True, gradient_accumulation_steps=4,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    with pytest.raises(ValueError, match=r"GradientAccumulationPlugin\(num_steps=...\)` must be a positive integer"):
        GradientAccumulationPlugin()


def test_adjust_scheduler_counts_the_calls_inside_a_window_but_steps_once() -> None:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    counts = []
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counts.append(scheduler.scheduler._step_count)
    assert scheduler.get_last_lr() == [0.25]  # two real steps: halved twice
    assert counts == [2, 3, 4, 5]  # plus the count a scheduler starts with


def test_grad_scaler_kwargs_reach_the_fp16_scaler() -> None:
    acc = Accelerator(cpu=True, mixed_precision="fp16",
                      kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=7)])
    assert acc.precision.scaler.get_scale() == 1024.0 and acc.precision.scaler.get_growth_interval() == 7
    with pytest.raises(TypeError, match=r"`GradScalerKwargs\(init_scale=...\)` must be a int or float"):
        GradScalerKwargs(init_scale="big")


def test_kwargs_handlers_and_rng_types_are_checked() -> None:
    with pytest.raises(TypeError, match="`kwargs_handlers` takes DistributedDataParallelKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[{"find_unused_parameters": True}])
    with pytest.raises(ValueError, match="two DistributedDataParallelKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])
    with pytest.raises(ValueError, match=r"comm_hook=...\)` must be one of 'no', 'fp16'"):
        DistributedDataParallelKwargs(comm_hook="zip")
    with pytest.raises(ValueError, match=r"backend=...\)` must be 'gloo', 'nccl' or None. Received: backend='mpi'"):
        InitProcessGroupKwargs(backend="mpi")
    with pytest.raises(TypeError, match="timeout=datetime.timedelta"):
        InitProcessGroupKwargs(timeout=30)
    assert Accelerator(cpu=True, rng_types=["generator"], kwargs_handlers=[
        InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5))]).num_processes == 1
    with pytest.raises(ValueError, match=r"`rng_types` holds \['xla'\], which fittrain does not synchronise"):
        Accelerator(cpu=True, rng_types=["generator", "xla"])
    with pytest.raises(TypeError, match="`rng_types` must be a list"):
        Accelerator(cpu=True, rng_types="generator")


def test_prepare_model_in_evaluation_mode_is_not_wrapped_and_prepare_scheduler_checks_its_input() -> None:
    acc = Accelerator(cpu=True)
    model = nn.Linear(2, 1)
    assert acc.prepare_model(model, evaluation_mode=True) is model and not acc.prepared.models
    with pytest.raises(TypeError, match="prepare_scheduler\\(\\) takes a torch LR scheduler. Received: Linear"):
        acc.prepare_scheduler(model)


def test_an_exported_dynamo_backend_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "EAGER")
    assert Accelerator(cpu=True).compile_options["backend"] == "eager"
    assert Accelerator(cpu=True, dynamo_backend="no").compile_options is None


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "iterable"])
def test_a_stateful_loader_resumes_after_load_state(tmp_path, stream: bool) -> None:
    """DataLoaderConfiguration(use_stateful_dataloader=True): after load_state (or load_state_dict)
    the next pass continues the saved epoch by itself, as a StatefulDataLoader does."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(32))

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = acc.prepare(DataLoader(Stream() if stream else list(range(32)), batch_size=4, shuffle=not stream))
    unseen = []
    for step, batch in enumerate(loader):
        if step == 2:
            acc.save_state(tmp_path / "checkpoint")
        if step > 2:
            unseen.append(batch.tolist())
    acc.load_state(tmp_path / "checkpoint")
    assert [batch.tolist() for batch in loader] == unseen and len(unseen) == 5
    assert len([batch for batch in loader]) == 8  # the pass after that is a whole epoch again


def test_options_accelerate_passes_on_are_named_not_ignored(tmp_path) -> None:
    acc = Accelerator(cpu=True)
    acc.prepare(nn.Linear(2, 1))
    with pytest.raises(TypeError, match=r"save_state\(\) got keyword arguments fittrain does not take: max_shard_size"):
        acc.save_state(tmp_path / "a", max_shard_size="1GB")
    with pytest.raises(ValueError, match=r"save_state\(safe_serialization=False\) is not supported"):
        acc.save_state(tmp_path / "a", safe_serialization=False)
    acc.save_state(tmp_path / "a", safe_serialization=True)
    with pytest.raises(ValueError, match=r"load_state\(strict=False\) is not supported"):
        acc.load_state(tmp_path / "a", strict=False)
    with pytest.raises(TypeError, match=r"load_state\(\) got keyword arguments fittrain does not take: map_location"):
        acc.load_state(tmp_path / "a", map_location="cpu")
    assert acc.load_state(tmp_path / "a", strict=True).endswith("a")


def test_autocast_kwargs_switch_autocast_off_for_a_block() -> None:
    from fittrain import AutocastKwargs

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    with acc.autocast(AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")
    off = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with off.autocast():
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(TypeError, match="`autocast_handler` must be a fittrain.utils.AutocastKwargs"):
        acc.autocast({"enabled": False})


def test_profile_records_and_writes_a_chrome_trace(tmp_path) -> None:
    from fittrain import ProfileKwargs

    acc = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path / "trace"),
                                                              record_shapes=True)])
    with acc.profile() as profiler:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert any("mm" in event.key for event in profiler.key_averages())
    assert (tmp_path / "trace" / "PROFILE_PROCESS_0.json").stat().st_size > 0
    with pytest.raises(ValueError, match=r"`ProfileKwargs\(activities=...\)` takes 'cpu' and 'cuda'"):
        ProfileKwargs(activities=["tpu"])


def test_dynamo_plugin_sets_the_compile_options() -> None:
    from fittrain import TorchDynamoPlugin

    acc = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="EAGER", fullgraph=True))
    assert acc.compile_options == {"backend": "eager", "fullgraph": True, "disable": False}
    with pytest.raises(ValueError, match="either `dynamo_backend` or `dynamo_plugin`"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=TorchDynamoPlugin())
    with pytest.raises(TypeError, match="`dynamo_plugin` must be a fittrain.utils.TorchDynamoPlugin"):
        Accelerator(cpu=True, dynamo_plugin={"backend": "eager"})
