# Ported from accelerate 1.15.0 accelerate/test_utils/scripts/external_deps/test_metrics.py; changes: imports only (accelerate -> fittrain, test helpers -> regression.py), checks that cannot apply removed (see the docstring below).

# Copyright 2022 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Accelerate's checks of `gather_for_metrics` (no duplicated or dropped samples), run against fittrain.

Run with `python -m torch.distributed.run --nproc-per-node N test_metrics.py` (N = 1 or 2).

Checks that cannot apply on fittrain (each replaced by a `# not applicable on fittrain` comment):
- The block of main() that runs only when `accelerator.device.type != "cpu"` (Accelerate runs
  it on GPUs and TPUs only): test_mrpc (with get_dataloader, get_mrpc_setup, and the imports
  of `evaluate`, `transformers`, `load_dataset`, `torch_device`, `is_torch_xla_available`; it
  downloads a BERT model and GLUE/MRPC from the Hub), test_gather_for_metrics_with_iterable_dataset
  (asserts the prepared loader is Accelerate's internal `DataLoaderDispatcher`) and
  test_gather_for_metrics_with_non_tensor_objects_iterable_dataset (both also read the
  "accelerate.accelerator" logger). These ports run on CPU processes.
- The transformers logging calls of main(): they only quieted the removed MRPC check, and
  transformers is not a dependency here.
- `dispatch_batches=True` in the "Test torch metrics" loop: one process reading and sending
  batches to the others; fittrain has every process read its own share and refuses it with an
  error. The loop keeps `dispatch_batches=False`, with both values of `split_batches`.
- `accelerator.state._reset_state()`: resets Accelerate's process-global state singleton;
  fittrain keeps no global state to reset.
"""

import logging

# not applicable on fittrain: `import math` (only the removed test_mrpc uses it)
import os
from copy import deepcopy

import datasets

# not applicable on fittrain: `import evaluate`, `import transformers`, `from datasets import load_dataset` and
# `from transformers import AutoModelForSequenceClassification, AutoTokenizer` (only the removed MRPC check uses them)
import torch
from torch.utils.data import DataLoader

# not applicable on fittrain: `IterableDataset` (only the removed GPU/TPU-only iterable-dataset checks use it)
from fittrain import Accelerator, DataLoaderConfiguration, DistributedType

# not applicable on fittrain: `torch_device` (only the removed MRPC setup uses it)
from fittrain.utils import set_seed

# not applicable on fittrain: `from accelerate.data_loader import DataLoaderDispatcher` (an Accelerate-internal
# class, used only by the removed GPU/TPU-only check)
from regression import RegressionDataset, RegressionModel

# not applicable on fittrain: `is_torch_xla_available` (only gated the removed GPU/TPU-only block)


os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "true"


class ListHandler(logging.Handler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logs = []

    def emit(self, record):
        self.logs.append(record)


def get_basic_setup(accelerator, num_samples=82, batch_size=16):
    "Returns everything needed to perform basic training"
    set_seed(42)
    model = RegressionModel()
    ddp_model = deepcopy(model)
    dset = RegressionDataset(length=num_samples)
    dataloader = DataLoader(dset, batch_size=batch_size)
    model.to(accelerator.device)
    ddp_model, dataloader = accelerator.prepare(ddp_model, dataloader)
    return model, ddp_model, dataloader


# not applicable on fittrain: get_dataloader and get_mrpc_setup (GLUE/MRPC and a BERT model from the Hub, for the
# GPU/TPU-only test_mrpc, removed below).


def generate_predictions(model, dataloader, accelerator):
    logits_and_targets = []
    for batch in dataloader:
        input, target = batch.values()
        with torch.no_grad():
            logit = model(input)
            logit, target = accelerator.gather_for_metrics((logit, target))
            logits_and_targets.append((logit, target))
    logits, targs = [], []
    for logit, targ in logits_and_targets:
        logits.append(logit)
        targs.append(targ)
    logits, targs = torch.cat(logits), torch.cat(targs)
    return logits, targs


def test_torch_metrics(
    accelerator: Accelerator, num_samples=82, dispatch_batches=False, split_batches=False, batch_size=16
):
    _, ddp_model, dataloader = get_basic_setup(accelerator, num_samples, batch_size)
    logits, _ = generate_predictions(ddp_model, dataloader, accelerator)
    assert len(logits) == num_samples, (
        f"Unexpected number of inputs:\n    Expected: {num_samples}\n    Actual: {len(logits)}"
    )


# not applicable on fittrain: test_mrpc (runs only on GPUs/TPUs in Accelerate's main, and downloads GLUE/MRPC
# and a BERT model from the Hub).


# not applicable on fittrain: test_gather_for_metrics_with_non_tensor_objects_iterable_dataset and
# test_gather_for_metrics_with_iterable_dataset (run only on GPUs/TPUs in Accelerate's main; the second asserts
# the prepared loader is Accelerate's internal DataLoaderDispatcher; both read the "accelerate.accelerator" logger).


def test_gather_for_metrics_drop_last():
    accelerator = Accelerator()
    per_device_batch_size = 5
    num_items = (10 * accelerator.num_processes) + 1
    dataloader = DataLoader(range(num_items), batch_size=per_device_batch_size, drop_last=True)
    dataloader = accelerator.prepare(dataloader)

    iterator = iter(dataloader)
    next(iterator)  # Skip first batch tensor([0, 1, 2, 3, 4], device='cuda:0')
    batch = next(iterator)
    gathered_items = accelerator.gather_for_metrics(batch)

    # Should return a full set of complete batches from each GPU
    num_expected_items = per_device_batch_size * accelerator.num_processes
    assert gathered_items.size(0) == (num_expected_items), (
        f"Expected number of items: {num_expected_items}, Actual: {gathered_items.size(0)}"
    )


def main():
    dataloader_config = DataLoaderConfiguration(split_batches=False, dispatch_batches=False)
    accelerator = Accelerator(dataloader_config=dataloader_config)
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        # not applicable on fittrain: transformers.utils.logging.set_verbosity_warning() (transformers is only
        # for the removed MRPC check)
    else:
        datasets.utils.logging.set_verbosity_error()
        # not applicable on fittrain: transformers.utils.logging.set_verbosity_error() (same reason)
    # TorchXLA does not support batch dispatching. 'put_on_device' is always False for
    # TorchXLA, which can cause a value error in 'prepare_data_loader' function.
    # not applicable on fittrain: dispatch_batches=True (fittrain refuses it: every process reads its own share);
    # Accelerate's line was `[False] if accelerator.state.distributed_type == DistributedType.XLA else [True, False]`
    dispatch_batches_options = [False]

    # not applicable on fittrain: the block that runs only when `accelerator.device.type != "cpu"` (test_mrpc for
    # each split_batches/dispatch_batches, test_gather_for_metrics_with_iterable_dataset and
    # test_gather_for_metrics_with_non_tensor_objects_iterable_dataset), removed above. These ports run on CPU.

    # MpDeviceLoader in TorchXLA is an asynchronous loader that preloads several batches into cache.
    # This can cause the 'end_of_dataloader' of DataLoaderStateMixin to be set earlier than intended.
    # Skip this test when TorchXLA is enabled.
    if accelerator.state.distributed_type != DistributedType.XLA:
        if accelerator.is_local_main_process:
            print("**Test torch metrics**")
        for split_batches in [True, False]:
            for dispatch_batches in dispatch_batches_options:
                dataloader_config = DataLoaderConfiguration(
                    split_batches=split_batches, dispatch_batches=dispatch_batches
                )
                accelerator = Accelerator(dataloader_config=dataloader_config)
                if accelerator.is_local_main_process:
                    print(f"With: `split_batches={split_batches}`, `dispatch_batches={dispatch_batches}`, length=99")
                test_torch_metrics(accelerator, 99)
                # not applicable on fittrain: accelerator.state._reset_state() (no process-global state to reset)
    if accelerator.is_local_main_process:
        print("**Test last batch is not dropped when perfectly divisible**")
    accelerator = Accelerator()
    test_torch_metrics(accelerator, 512)
    # not applicable on fittrain: accelerator.state._reset_state() (no process-global state to reset)
    if accelerator.is_local_main_process:
        print("**Test that `drop_last` is taken into account**")
    test_gather_for_metrics_drop_last()
    accelerator.end_training()
    # not applicable on fittrain: accelerator.state._reset_state() (no process-global state to reset)


def _mp_fn(index):
    # For xla_spawn (TPUs)
    main()


if __name__ == "__main__":
    main()
