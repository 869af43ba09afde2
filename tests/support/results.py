"""Reading what a job's ranks saved, and comparing model states."""

from __future__ import annotations

import pathlib
from typing import Any

import torch


def read_results(out: pathlib.Path, ranks: int) -> list[dict[str, Any]]:
    """What each rank saved with torch.save as `out/rank{r}.pt`, in rank order."""
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def assert_state_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    """Same keys, and every tensor within `atol` of the expected one."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        diff = (actual[key].float() - expected[key].float()).abs().max().item()
        assert diff <= atol, f"{key} differs by {diff:.3g} (allowed {atol:g})"


def assert_state_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys and bit-identical tensors."""
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{key} differs"
