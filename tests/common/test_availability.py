"""Accelerate's `is_*_available` family in `fittrain.utils`: every name, truthful answers."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import fittrain.utils

#: The `is_*_available` names that `accelerate.utils` exports (Accelerate 1.14's utils/__init__.py).
ACCELERATE_NAMES = [
    "is_4bit_bnb_available", "is_8bit_bnb_available", "is_aim_available", "is_amdsmi_available", "is_bf16_available",
    "is_bitsandbytes_multi_backend_available", "is_bnb_available", "is_boto3_available", "is_clearml_available",
    "is_comet_ml_available", "is_cuda_available", "is_datasets_available", "is_deepspeed_available",
    "is_dvclive_available", "is_fp16_available", "is_fp8_available", "is_hpu_available", "is_import_timer_available",
    "is_lomo_available", "is_matplotlib_available", "is_megatron_lm_available", "is_mlflow_available",
    "is_mlu_available", "is_mps_available", "is_msamp_available", "is_musa_available", "is_neuron_available",
    "is_npu_available", "is_pandas_available", "is_peft_available", "is_pippy_available", "is_pynvml_available",
    "is_pytest_available", "is_rich_available", "is_rocm_available", "is_sagemaker_available",
    "is_schedulefree_available", "is_sdaa_available", "is_swanlab_available", "is_tensorboard_available",
    "is_timm_available", "is_torch_xla_available", "is_torchao_available", "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available", "is_torchvision_available", "is_trackio_available",
    "is_transformer_engine_available", "is_transformer_engine_mxfp8_available", "is_transformers_available",
    "is_triton_available", "is_wandb_available", "is_weights_only_available", "is_xccl_available",
    "is_xpu_available",
]


@pytest.mark.parametrize("name", ACCELERATE_NAMES)
def test_every_accelerate_name_exists_and_answers_a_bool(name: str) -> None:
    assert name in fittrain.utils.__all__
    assert isinstance(getattr(fittrain.utils, name)(), bool)


def test_installed_and_absent_packages_are_told_apart() -> None:
    assert fittrain.utils.is_tensorboard_available() is True  # a dependency of fittrain
    assert fittrain.utils.is_pytest_available() is True
    # Packages nobody installs for fittrain's tests (other tests' helpers may install schedulefree).
    absent = [(module, question) for module, question in (
        ("deepspeed", "is_deepspeed_available"), ("torch_xla", "is_torch_xla_available"),
        ("lomo_optim", "is_lomo_available"), ("import_timer", "is_import_timer_available"))
        if importlib.util.find_spec(module) is None]
    assert absent, "every candidate absent package is installed here; add another to the list"
    for _, question in absent:
        assert getattr(fittrain.utils, question)() is False
    for module, question in (("transformers", "is_transformers_available"), ("datasets", "is_datasets_available"),
                             ("wandb", "is_wandb_available"), ("mlflow", "is_mlflow_available"),
                             ("schedulefree", "is_schedulefree_available")):
        assert getattr(fittrain.utils, question)() is (importlib.util.find_spec(module) is not None)


def test_devices_are_asked_of_torch() -> None:
    assert fittrain.utils.is_cuda_available() is torch.cuda.is_available()
    assert fittrain.utils.is_npu_available() is False  # torch_npu is not installed
    assert fittrain.utils.is_bf16_available() is True or torch.cuda.is_available()
    assert fittrain.utils.is_weights_only_available() is True  # torch >= 2.4


@pytest.fixture()
def on_path(tmp_path, monkeypatch):
    """A folder put first on sys.path, for packages made up by the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    importlib.invalidate_caches()


def _package(root, name: str, version: str | None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("raise RuntimeError('the availability check imported me')\n")
    if version is not None:
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    importlib.invalidate_caches()


def test_a_folder_named_like_a_package_is_not_the_package(on_path) -> None:
    _package(on_path, "import_timer", None)
    assert importlib.util.find_spec("import_timer") is not None
    assert fittrain.utils.is_import_timer_available() is False


def test_an_installed_package_is_seen_without_importing_it(on_path) -> None:
    _package(on_path, "import_timer", "1.4")
    assert fittrain.utils.is_import_timer_available() is True
    assert "import_timer" not in sys.modules


@pytest.mark.parametrize("version, expected", [("0.5.0", False), ("0.6.1", True), ("0.10.0rc1", True)])
def test_version_bounds_are_checked_where_accelerate_checks_them(on_path, version: str, expected: bool) -> None:
    _package(on_path, "torchao", version)  # Accelerate: torchao >= 0.6.1
    assert fittrain.utils.is_torchao_available() is expected


def test_min_version_of_bitsandbytes(on_path) -> None:
    _package(on_path, "bitsandbytes", "0.38.0")
    assert fittrain.utils.is_bnb_available() is True
    assert fittrain.utils.is_bnb_available(min_version="0.39.0") is False
    assert fittrain.utils.is_8bit_bnb_available() is True and fittrain.utils.is_4bit_bnb_available() is False
