"""`PartialState` and `fittrain.utils`' collectives on 2 real gloo processes, next to an Accelerator."""

from __future__ import annotations

import json
import pathlib

import pytest

from support.jobs import forked, run

pytestmark = pytest.mark.subprocess


def test_partial_state_utils_decorators_and_triggers_on_two_processes(tmp_path: pathlib.Path) -> None:
    run(forked(2, "partial_state_worker.py", str(tmp_path))).check()
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for facts in (rank0, rank1):
        assert facts["agree"] == [True] * 4  # one source of truth: no state to disagree
        assert facts["triggers"] == [True, False]  # rank 1's trigger reaches both, once
        assert facts["gather"] == [0, 1] and facts["gather_object"] == ["r0", "r1"]
        assert facts["reduce_mean"] == [1.5, 9.5]  # accelerate.utils.reduce averages by default
        assert facts["reduce_max"] == [2.0, 10.0] and facts["reduce_min"] == [1.0, 9.0]
        assert facts["broadcast"] == [6] and facts["object_list"] == [{"rank": 0}]  # from process 0 by default
    assert (rank0["is_last"], rank1["is_last"]) == (False, True)
    # One machine: rank 1 is local rank 1.
    assert rank0["ran"] == ["main", "local_main"] and rank1["ran"] == ["last", "one"]
    assert rank0["padded"] == [1.0, 0.0] and rank1["padded"] == [1.0, 1.0]
    for facts in (rank0, rank1):
        assert facts["pad_mismatch"].startswith("Cannot pad across processes along dim 0")
