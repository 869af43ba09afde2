"""`Trainer(strategy="ddp", devices=2, accelerator="cpu")` on 2 gloo processes: Lightning starting its
second process itself, fittrain.lightning under `fittrain launch --num_processes 2`, the same program
(tests/lightning/programs/ddp_program.py) with only its imports changed. Each process's record (metrics
logged with and without sync_dist, gradient norms, a rank_zero_only function's result, EarlyStopping's
decision, test and predict results, log and checkpoint folders, the CSV rank 0 wrote, the weights) must
be Lightning's, rank by rank."""

from __future__ import annotations

import json
import pathlib

import pytest

from lightning_programs import differences
from support import jobs

pytestmark = pytest.mark.subprocess

PROGRAM = pathlib.Path(__file__).parent / "programs" / "ddp_program.py"
TIMEOUT = 240.0  # each run imports torch and Lightning or fittrain in two processes


def _records(workdir: pathlib.Path, finished: jobs.Finished) -> dict[str, dict]:
    found = sorted(path.name for path in workdir.glob("rank*.json"))
    assert found == ["rank0.json", "rank1.json"], f"ranks wrote {found}:\n{finished.output[-4000:]}"
    return {name: json.loads((workdir / name).read_text()) for name in found}


def _without_lightning(folder: pathlib.Path) -> pathlib.Path:
    """A folder of `lightning` packages that refuse to import, first on the fittrain run's path."""
    for name in ("lightning", "pytorch_lightning"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text("raise ImportError('the fittrain run imported Lightning')\n")
    return folder


def test_ddp_on_two_processes_matches_lightning(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("lightning")
    lightning_dir, fittrain_dir = tmp_path / "lightning", tmp_path / "fittrain"
    lightning_dir.mkdir()
    fittrain_dir.mkdir()
    lightning_job = jobs.job_env(MASTER_PORT=str(jobs.free_port()))  # Lightning's own DDP rendezvous
    fittrain_env = jobs.job_env(PYTHONPATH=str(_without_lightning(tmp_path / "no_lightning")))
    lightning_run = jobs.run(jobs.python_script(PROGRAM, "lightning", lightning_dir), env=lightning_job,
                             timeout=TIMEOUT, cwd=lightning_dir).check()
    fittrain_run = jobs.run(jobs.fittrain_launch(2, PROGRAM, "fittrain", fittrain_dir), env=fittrain_env,
                            timeout=TIMEOUT, cwd=fittrain_dir).check()
    lightning, fittrain = _records(lightning_dir, lightning_run), _records(fittrain_dir, fittrain_run)
    found = differences(lightning, fittrain)
    assert not found, "2 processes differ from Lightning:\n" + "\n".join(found)
    ranks = [fittrain["rank0.json"], fittrain["rank1.json"]]
    assert [r["global_rank"] for r in ranks] == [0, 1] and [r["is_global_zero"] for r in ranks] == [True, False]
    assert ranks[0]["fit"]["val_loss"] != ranks[1]["fit"]["val_loss"]  # each process's own mean...
    assert ranks[0]["fit"]["val_loss_sync"] == ranks[1]["fit"]["val_loss_sync"]  # ...and, with sync_dist, one
    assert "csv_header" in ranks[0] and "csv_header" not in ranks[1]
    assert [r["rank_zero_only"] for r in ranks] == ["ran", None]
    assert ranks[0]["fit"]["grad_2.0_norm_total"] > 0


def test_a_run_resumed_mid_epoch_on_two_processes_ends_as_the_uninterrupted_one(tmp_path: pathlib.Path) -> None:
    program = pathlib.Path(__file__).parent / "programs" / "resume_program.py"
    finished = jobs.run(jobs.fittrain_launch(2, program, tmp_path), timeout=TIMEOUT, cwd=tmp_path).check()
    records = _records(tmp_path, finished)
    for name, record in records.items():
        assert record["resumed"] == record["full"], f"{name}: the resumed run differs from the uninterrupted one"
    assert records["rank0.json"]["full"]["step"] == 18
