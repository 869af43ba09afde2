"""The mark every test in tests/gpu carries: they need CUDA, which the rest of the suite hides."""

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device, and FITTRAIN_TEST_CUDA=1 on a GPU machine (tests/conftest.py hides CUDA otherwise)")
