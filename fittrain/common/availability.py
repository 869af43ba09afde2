"""Accelerate's `is_*_available` family: whether a package is installed, or a device is present.

Scripts written for Accelerate ask `accelerate.utils` before importing an optional package
(`if is_schedulefree_available(): import schedulefree`) or picking a device. fittrain answers
the same questions truthfully, from this machine: a package question is answered by
`importlib.util.find_spec` plus the installed distribution's metadata (a stray folder named like
the package does not count, and a version bound is checked where Accelerate checks one), without
importing the package; a device question asks torch.

The answer is about the package, not about fittrain: `is_deepspeed_available()` is True when
deepspeed is installed even though fittrain never uses it, so a script's own `import deepspeed`
behind that test works as it did under Accelerate.

All package questions share one implementation (`_package`), and all device questions another
(`_device`); the names below only say which package or device each asks about.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Callable

import torch

__all__ = [
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


def _version_tuple(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("0.39.1rc2" -> (0, 39, 1))."""
    numbers = []
    for part in text.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):  # "1rc2": the release numbers end here
            break
    return tuple(numbers)


def _installed_version(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of `distributions` that is installed, or None."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _is_installed(module: str, distributions: tuple[str, ...] = (), minimum: str | None = None,
                  below: str | None = None) -> bool:
    """Whether `module` imports from an installed distribution (one of `distributions`, default the
    module's name) whose version is at least `minimum` and below `below`; nothing is imported."""
    if importlib.util.find_spec(module) is None:
        return False
    found = _installed_version(distributions or (module,))
    if found is None:
        return False  # a folder named like the package, not an installed package
    release = _version_tuple(found)
    if minimum is not None and release < _version_tuple(minimum):
        return False
    return below is None or release < _version_tuple(below)


def _package(module: str, *distributions: str, minimum: str | None = None,
             below: str | None = None) -> Callable[[], bool]:
    """An `is_*_available()` for a package: `module` importable from one of `distributions`."""

    def available() -> bool:
        return _is_installed(module, distributions, minimum, below)

    available.__doc__ = f"Whether `{module}` is installed (answered without importing it)."
    return available


def _device(name: str, plugin: str | None = None) -> Callable[..., bool]:
    """An `is_*_available(check_device=False)` for a torch device type: `torch.{name}` reports it
    available (and, with `plugin`, the package that adds the device to torch is installed)."""

    def available(check_device: bool = False) -> bool:
        if plugin is not None and importlib.util.find_spec(plugin) is None:
            return False
        backend = getattr(torch, name, None)
        if backend is None or not backend.is_available():
            return False
        return not check_device or backend.device_count() > 0

    available.__doc__ = f"Whether torch has a usable `{name}` device (check_device: and counts at least one)."
    return available


is_aim_available = _package("aim", below="4.0.0")
is_amdsmi_available = _package("amdsmi")
is_boto3_available = _package("boto3")
is_clearml_available = _package("clearml")
is_comet_ml_available = _package("comet_ml")
is_datasets_available = _package("datasets")
is_deepspeed_available = _package("deepspeed")
is_dvclive_available = _package("dvclive")
is_import_timer_available = _package("import_timer")
is_lomo_available = _package("lomo_optim")
is_matplotlib_available = _package("matplotlib")
is_megatron_lm_available = _package("megatron", "megatron-core", minimum="0.8.0")
is_mlflow_available = _package("mlflow", "mlflow", "mlflow-skinny")
is_msamp_available = _package("msamp", "ms-amp")
is_pandas_available = _package("pandas")
is_peft_available = _package("peft")
is_pynvml_available = _package("pynvml", "pynvml", "nvidia-ml-py")
is_pytest_available = _package("pytest")
is_sagemaker_available = _package("sagemaker")
is_schedulefree_available = _package("schedulefree")
is_swanlab_available = _package("swanlab")
is_timm_available = _package("timm")
is_torchao_available = _package("torchao", minimum="0.6.1")
is_torchdata_available = _package("torchdata")
is_torchdata_stateful_dataloader_available = _package("torchdata", minimum="0.8.0")
is_torchvision_available = _package("torchvision")
is_transformer_engine_available = _package("transformer_engine", "transformer-engine", "transformer_engine")
is_transformers_available = _package("transformers")
is_triton_available = _package("triton", "triton", "pytorch-triton", "triton-xpu")
is_wandb_available = _package("wandb")
is_4bit_bnb_available = _package("bitsandbytes", minimum="0.39.0")
is_8bit_bnb_available = _package("bitsandbytes", minimum="0.37.2")

is_mlu_available = _device("mlu", "torch_mlu")
is_musa_available = _device("musa", "torch_musa")
is_neuron_available = _device("neuron", "torch_neuronx")
is_npu_available = _device("npu", "torch_npu")
is_sdaa_available = _device("sdaa", "torch_sdaa")
is_xpu_available = _device("xpu")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether `bitsandbytes` is installed (at least `min_version`, when given)."""
    return _is_installed("bitsandbytes", minimum=min_version)


def is_tensorboard_available() -> bool:
    """Whether `tensorboard` (a dependency of fittrain) or `tensorboardX` is installed."""
    return _is_installed("tensorboard") or _is_installed("tensorboardX")


def is_trackio_available() -> bool:
    """Whether `trackio` is installed (it needs Python 3.10 or newer)."""
    return sys.version_info >= (3, 10) and _is_installed("trackio")


def is_rich_available() -> bool:
    """Whether `rich` is installed and enabled with ACCELERATE_ENABLE_RICH=1 (as in Accelerate)."""
    enabled = os.environ.get("ACCELERATE_ENABLE_RICH", "").strip().lower() in ("1", "true", "yes", "on")
    return enabled and _is_installed("rich")


def is_fp8_available() -> bool:
    """Whether an fp8 package (MS-AMP, Transformer Engine, torchao) is installed.

    fittrain itself trains in "no", "fp16" or "bf16" only; this answers Accelerate's question.
    """
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and reports MXFP8 support on this GPU."""
    if not is_transformer_engine_available():
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support  # only when installed

    return bool(check_mxfp8_support()[0])


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed `bitsandbytes` has its multi-backend feature (imports it when installed)."""
    if not is_bnb_available():
        return False
    import bitsandbytes  # only when installed

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether torch is a ROCm build and sees an AMD GPU."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is built into torch and present."""
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_built() and mps.is_available()


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether Habana's `habana_frameworks` is installed and torch sees an HPU."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    hpu = getattr(torch, "hpu", None)
    return hpu is not None and hpu.is_available()


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether `torch_xla` is installed (with a check: and its runtime is a TPU, or a GPU).

    fittrain does not run on XLA devices; this answers Accelerate's question about the machine.
    """
    if not _is_installed("torch_xla"):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime  # only when installed and asked about the device

    kind = torch_xla.runtime.device_type()
    return kind == "TPU" if check_is_tpu else kind in ("GPU", "CUDA")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 works here: on CUDA when the GPU supports it; on the CPU always."""
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    """Whether fp16 works here (with its loss scaler): always, on CUDA and on the CPU."""
    return True


def is_pippy_available() -> bool:
    """Whether torch has pipeline parallelism (`torch.distributed.pipelining`; fittrain does not use it)."""
    return importlib.util.find_spec("torch.distributed.pipelining") is not None


def is_weights_only_available() -> bool:
    """Whether `torch.load(weights_only=True)` takes an allow-list (torch 2.4 and newer)."""
    return _version_tuple(torch.__version__) >= (2, 4)


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend."""
    check = getattr(torch.distributed.distributed_c10d, "is_xccl_available", None)
    return bool(check is not None and check())
