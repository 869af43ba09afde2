"""The helpers Accelerate's test scripts import from `accelerate.test_utils`, written for fittrain.

The ported scripts next to this file (see test_ops.py and the others) import these names from
here instead of from `accelerate.test_utils`. They are written from the behaviour Accelerate
documents for them, with the same seeds and the same arithmetic, so the expected numbers in
the scripts hold unchanged:

- `RegressionDataset(a, b, length, seed)`: `length` samples of y = a*x + b + noise, with x and
  the noise (std 0.1) drawn, in that order, from `numpy.random.default_rng(seed)` as float32;
  item i is `{"x": x[i], "y": y[i]}`.
- `RegressionModel(a, b)`: the model `x * a + b` with two scalar float32 parameters.
- `are_the_same_tensors(tensor)`: whether every process holds the same tensor.
- `assert_exception(exception_class, msg)`: a context manager asserting that its block raises
  `exception_class` (with `msg` in its message, when given).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from fittrain import PartialState
from fittrain.utils import gather


class RegressionDataset:
    """Samples of the line y = a*x + b plus Gaussian noise, reproducible from `seed`.

    Args:
        a: The slope.
        b: The intercept.
        length: How many samples.
        seed: The seed of the numpy generator that draws x, then the noise; None draws fresh ones.
    """

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None) -> None:
        generator = np.random.default_rng(seed)
        self.length = length
        self.x = generator.normal(size=(length,)).astype(np.float32)
        noise = generator.normal(scale=0.1, size=(length,)).astype(np.float32)
        self.y = a * self.x + b + noise

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.float32]:
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(torch.nn.Module):
    """`x * a + b`, with `a` and `b` scalar float32 parameters.

    Args:
        a: The initial slope.
        b: The initial intercept.
        double_output: Accepted for signature compatibility; unused (as in Accelerate).
    """

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.first_batch:
            # Accelerate's model reports the dtypes it runs in once; scripts' logs show it.
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is equal, element for element, on every process (a collective)."""
    state = PartialState()
    mine = tensor[None].clone().to(state.device)
    everyone = gather(mine).cpu()
    mine = mine[0].cpu()
    return all(torch.equal(everyone[i], mine) for i in range(everyone.shape[0]))


@contextlib.contextmanager
def assert_exception(exception_class: type[BaseException], msg: str | None = None) -> Iterator[None]:
    """Asserts that the block raises `exception_class`, and that `msg` is part of its message.

    Raises:
        AssertionError: when the block raises nothing, another exception, or another message.
    """
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any exception is checked against the expected one
        assert isinstance(error, exception_class), f"Expected exception of type {exception_class} but got {type(error)}"
        if msg is not None:
            assert msg in str(error), f"Expected message '{msg}' to be in exception but got '{error}'"
        return
    raise AssertionError(f"Expected exception of type {exception_class} but ran without issue.")
