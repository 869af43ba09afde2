"""ProcessState, the collective timeout and strategy resolution, on one process (no process group).

Multi-process behaviour is tested with real processes in tests/distributed/.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist

from fittrain import Accelerator, DistributedType
from fittrain.distributed.parallel import STRATEGY_ENV, check_strategy, resolve_strategy
from fittrain.distributed.process_state import DEFAULT_TIMEOUT, TIMEOUT_ENV, ProcessState, collective_timeout

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", TIMEOUT_ENV, STRATEGY_ENV)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_without_torchrun_it_is_one_process() -> None:
    state = ProcessState.from_environment(cpu=True)
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process and not state.is_distributed
    assert state.backend is None and state.device == torch.device("cpu")
    for strategy in ("auto", "ddp", "fsdp"):
        assert dataclasses.replace(state, strategy=strategy).distributed_type == DistributedType.NO
    state.barrier()  # free and harmless with one process
    state.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize("device, strategy, expected", [
    ("cpu", "auto", DistributedType.MULTI_CPU), ("cpu", "ddp", DistributedType.MULTI_CPU),
    ("cuda", "ddp", DistributedType.MULTI_GPU), ("cpu", "fsdp", DistributedType.FSDP),
])
def test_distributed_type_names_the_setup(device: str, strategy: str, expected: DistributedType) -> None:
    state = ProcessState(4, 2, 0, torch.device(device, 0) if device == "cuda" else torch.device(device), "gloo",
                         strategy)
    assert state.distributed_type == expected


def test_local_main_is_per_node() -> None:
    state = ProcessState(4, 2, 0, torch.device("cpu"), "gloo")  # first process on the second node
    assert state.is_local_main_process and not state.is_main_process


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "RANK must be in [0, WORLD_SIZE). Received: RANK=2, WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
])
def test_broken_launcher_environment_fails_fast_and_clearly(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        ProcessState.from_environment(cpu=True)
    assert message in str(error.value)
    assert not dist.is_initialized()


def test_collective_timeout_defaults_to_half_an_hour() -> None:
    assert collective_timeout() == DEFAULT_TIMEOUT == datetime.timedelta(minutes=30)


@pytest.mark.parametrize("value, seconds", [("90", 90.0), ("2.5", 2.5), (" 600 ", 600.0)])
def test_collective_timeout_reads_seconds_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, value: str, seconds: float) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    assert collective_timeout() == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_bad_collective_timeout_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a positive number of seconds. "
                                         f"Received: {TIMEOUT_ENV}='{value}'"):
        collective_timeout()


def test_unknown_strategy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"`strategy` must be one of 'auto', 'ddp', 'fsdp'. Received: strategy='zero'"):
        Accelerator(strategy="zero")
    with pytest.raises(ValueError, match="Received: strategy=None"):
        check_strategy(None)


def test_launcher_strategy_applies_only_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_strategy("auto") == "auto"
    monkeypatch.setenv(STRATEGY_ENV, "FSDP")
    assert resolve_strategy("auto") == "fsdp"
    assert resolve_strategy("ddp") == "ddp"  # the script's explicit choice wins
    monkeypatch.setenv(STRATEGY_ENV, "zero")
    with pytest.raises(ValueError, match=f"`{STRATEGY_ENV}` must be one of .* Received: {STRATEGY_ENV}='zero'"):
        resolve_strategy("auto")


def test_accelerator_honours_the_launcher_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STRATEGY_ENV, "fsdp")
    assert Accelerator().strategy == "fsdp"
