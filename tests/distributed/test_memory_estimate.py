"""`estimate_memory` and `fittrain estimate`: each process's bytes under a layout, checked against
what real processes hold (the 4-process `hsdp_job`, conftest.py) and against hand counts."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest
import torch
from torch import nn

from fittrain import ParallelismConfig
from fittrain.distributed.memory_estimate import estimate_memory, saved_activation_bytes
from fittrain.launch import cli

#: The Done-when bound; the counts are exact for plain tensors, so this only absorbs FSDP2's padding.
TOLERANCE = 0.10


@pytest.mark.subprocess
@pytest.mark.parametrize("layout, name", [(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), "hsdp"),
                                          (ParallelismConfig(dp_shard_size=4), "fsdp")])
def test_the_estimate_matches_what_each_rank_holds(hsdp_job: dict[str, Any], training: Any,
                                                   layout: ParallelismConfig, name: str) -> None:
    with torch.device("meta"):
        model = training.make_model()
    estimate = estimate_memory(model, layout, "adamw")
    for rank in hsdp_job["ranks"][:1]:  # rank 0 holds the largest (padded) shard of every parameter
        held = rank["memory"][name]
        for part in ("parameters", "gradients", "optimizer_state"):
            assert abs(getattr(estimate, part) - held[part]) <= TOLERANCE * held[part], (part, estimate, held)


def test_one_process_holds_everything_and_sgd_keeps_no_state() -> None:
    model = nn.Linear(10, 4)  # 44 float32 parameters: 176 bytes
    assert estimate_memory(model, optimizer="adamw") == estimate_memory(model, ParallelismConfig(dp_replicate_size=8))
    adam, sgd = estimate_memory(model), estimate_memory(model, optimizer="sgd")
    assert (adam.parameters, adam.gradients, adam.optimizer_state) == (176, 176, 2 * 176 + 2 * 4)
    assert (sgd.optimizer_state, sgd.activations) == (0, None)
    # FSDP2 over 3: the weight's 4 rows become 2 per process (padded), the bias's 4 elements 2.
    assert estimate_memory(model, ParallelismConfig(dp_shard_size=3), "sgd").parameters == (2 * 10 + 2) * 4


def test_activations_are_the_tensors_saved_for_backward_parameters_excluded() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    # Linear saves its input (2x4 floats); ReLU saves its output (2x3); the weight is not counted.
    assert saved_activation_bytes(model, torch.zeros(2, 4)) == (2 * 4 + 2 * 3) * 4
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    assert estimate_memory(meta, sample=torch.zeros(2, 4, device="meta")).activations == (2 * 4 + 2 * 3) * 4


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"optimizer=\.\.\.\) must be one of adam, adamw, sgd, sgd-momentum\. "
                                         r"Received: optimizer='lion'"):
        estimate_memory(nn.Linear(2, 2), optimizer="lion")
    with pytest.raises(ValueError, match=r"Received: cp_size=2\. Use cp_size=1"):
        estimate_memory(nn.Linear(2, 2), ParallelismConfig(cp_size=2))
    with pytest.raises(ValueError, match=r"Linear \(and every module in it\) has none"):
        estimate_memory(nn.Linear(2, 2), ParallelismConfig(tp_size=2))


def test_the_command_builds_the_model_on_meta_and_prints_each_part(tmp_path: pathlib.Path, capsys,
                                                                   monkeypatch) -> None:
    (tmp_path / "estimate_models.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n    assert torch.empty(1).device.type == 'meta'\n    return nn.Linear(1024, 1024)\n"
        "def broken():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["estimate", "estimate_models:build", "--dp_shard_size", "4", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "dp_replicate_size=1, dp_shard_size=4" in out
    assert "parameters" in out and f"{(256 * 1024 + 256) * 4 / 2**20:.3f} MiB" in out  # a quarter of the rows
    assert cli.main(["estimate", "estimate_models:broken"]) == 1
    assert "estimate_models:broken() must return an nn.Module. Received: int" in capsys.readouterr().err
    assert cli.main(["estimate", "estimate_models"]) == 1
    assert "must be given as module:function. Received: 'estimate_models'" in capsys.readouterr().err
    sys.modules.pop("estimate_models", None)
