"""`fittrain.lightning.utilities` (rank_zero_only, grad_norm, the type aliases) and the LightningModule
attributes `dtype`, `freeze`, `unfreeze`, against Lightning's own. The 2-process run of rank_zero_only and
grad_norm is in tests/lightning/programs/ddp_program.py."""

from __future__ import annotations

import pytest
import torch

import fittrain.lightning as pl
from fittrain.lightning import utilities
from fittrain.lightning.utilities import grad_norm, rank_zero_only, types

lightning = pytest.importorskip("lightning.pytorch")


def _module_with_gradients() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1, bias=False))
    layers(torch.randn(5, 3)).pow(2).sum().backward()
    return torch.nn.ModuleDict({"layers": layers, "unused": torch.nn.Linear(2, 2)})  # no gradient: left out


@pytest.mark.parametrize("norm_type", [2, 1, 2.5, "inf", "2"])
def test_grad_norm_gives_lightnings_names_and_values(norm_type):
    from lightning.pytorch.utilities import grad_norm as lightnings

    module = _module_with_gradients()
    ours, theirs = grad_norm(module, norm_type), lightnings(module, norm_type)
    assert list(ours) == list(theirs) and len(ours) == 4
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-6), name
    assert grad_norm(module, 2, group_separator=".").keys() == lightnings(module, 2, group_separator=".").keys()
    assert grad_norm(torch.nn.Linear(2, 2), 2) == {}


@pytest.mark.parametrize("norm_type", [0, -1, "two", None])
def test_grad_norm_refuses_a_norm_that_is_not_positive_naming_it(norm_type):
    with pytest.raises(ValueError, match=rf"grad_norm\(norm_type=\.\.\.\) must be a positive number or 'inf'.*"
                                         rf"Received: norm_type={norm_type!r}\. Pass 2"):
        grad_norm(_module_with_gradients(), norm_type)


def test_rank_zero_only_runs_on_global_rank_zero_only(monkeypatch):
    calls = []

    @rank_zero_only
    def note(value):
        """Documented."""
        calls.append(value)
        return value

    fallback = rank_zero_only(lambda: "ran", default="skipped")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert note(1) == 1 and fallback() == "ran"  # a lone process is rank 0
    monkeypatch.setenv("RANK", "1")  # the second process of a torchrun job, before its process group exists
    assert note(2) is None and fallback() == "skipped"
    assert calls == [1] and note.__doc__ == "Documented."
    with pytest.warns(UserWarning, match="on rank 0"):
        monkeypatch.setenv("RANK", "0")
        utilities.rank_zero_warn("on rank 0")


def test_the_type_aliases_have_lightnings_names():
    from lightning.pytorch.utilities import rank_zero as lightning_rank_zero
    from lightning.pytorch.utilities import types as lightning_types

    from fittrain.lightning.utilities import rank_zero

    for name in types.__all__:
        assert hasattr(lightning_types, name), name
    assert set(utilities.__all__) <= set(dir(lightning.utilities))
    assert all(hasattr(lightning_rank_zero, name) for name in dir(rank_zero) if name.startswith("rank_zero"))


def test_dtype_freeze_and_unfreeze_are_lightnings():
    def observe(namespace):
        class Module(namespace.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(2, 2)

        module = Module()
        seen = [module.dtype]
        module.freeze()
        seen += [module.training, [p.requires_grad for p in module.parameters()]]
        module.unfreeze()
        seen += [module.training, [p.requires_grad for p in module.parameters()]]
        module.double()
        seen.append(module.dtype)
        return seen

    assert observe(pl) == observe(lightning) == [torch.float32, False, [False, False], True, [True, True],
                                                 torch.float64]
