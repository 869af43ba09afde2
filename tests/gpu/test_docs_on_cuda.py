"""Every docs page's ```python blocks run where CUDA is visible, as on a reader's GPU machine.

tests/project/test_docs.py runs them on the CPU, where a tensor made without `device=` inside
`training_step` still works; here the Trainer and Accelerator pick the GPU, so it would not.
"""

from __future__ import annotations

import pathlib

import pytest

from gpu_support import needs_cuda
from support.doc_pages import RUNNABLE, page_id, run_page

pytestmark = needs_cuda


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_blocks_run_on_cuda(page: pathlib.Path, tmp_path: pathlib.Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run_page(page, tmp_path, monkeypatch)
