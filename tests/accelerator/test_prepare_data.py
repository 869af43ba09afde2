"""`prepare_data_loader` without an Accelerator object (Accelerate's function), on one process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from fittrain.accelerator.prepare_data import prepare_data_loader


def test_one_process_gets_every_batch_in_the_loaders_order() -> None:
    loader = DataLoader(torch.arange(10.0), batch_size=4)
    prepared = prepare_data_loader(loader, device="cpu", num_processes=1, process_index=0, put_on_device=True)
    assert [b.tolist() for b in prepared] == [b.tolist() for b in loader]
    assert len(prepared) == 3


@pytest.mark.parametrize("name", ["slice_fn_for_dispatch", "torch_device_mesh"])
def test_options_fittrain_does_not_have_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"prepare_data_loader\({name}=\.\.\.\) is not supported.*Received: {name}="):
        prepare_data_loader(DataLoader(list(range(4))), device="cpu", **{name: object()})


@pytest.mark.parametrize("name, value", [("num_processes", 2), ("process_index", 1)])
def test_a_process_layout_that_is_not_the_groups_is_refused(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"prepare_data_loader\({name}={value}\) does not match the process group, "
                                         r"where it is \d.*Leave it out or pass"):
        prepare_data_loader(DataLoader(list(range(4))), device="cpu", **{name: value})
