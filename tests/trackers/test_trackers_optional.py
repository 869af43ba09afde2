"""The optional trackers, offline: wandb (`WANDB_MODE=offline`) and mlflow (a file store in tmp_path).

Both packages are in the `dev` extra, so CI runs these tests; they are skipped only where the
package is absent. No test touches the network: wandb runs offline with every folder it writes
(run, config, cache, data) inside tmp_path, in a subprocess with a deadline, so a wandb that
tried to log in or hung would fail the test instead of blocking it. What was logged is read
back with each tool's own format: wandb's offline run file (its protobuf records), mlflow's
`MlflowClient`.
"""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.subprocess

DEADLINE = 180  # seconds a wandb subprocess may take before it is killed


def _offline_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """Environment that keeps wandb and mlflow off the network and inside tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "wandb_dir"),
               WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
               WANDB_DATA_DIR=str(tmp_path / "wandb_data"), WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true",
               WANDB_CONSOLE="off", WANDB_X_DISABLE_STATS="true", WANDB_INIT_TIMEOUT="120",
               MLFLOW_TRACKING_URI=f"file://{tmp_path}/mlruns", MLFLOW_ALLOW_FILE_STORE="true",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def _run(code: str, tmp_path: pathlib.Path) -> None:
    """Runs `code` in a fresh interpreter in tmp_path; kills it past the deadline."""
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=_offline_env(tmp_path),
                              capture_output=True, text=True, timeout=DEADLINE)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"still running after {DEADLINE}s (killed): {str(err.stderr)[-3000:]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _wandb_records(folder: pathlib.Path) -> list:
    """The records of the one offline wandb run under `folder` (its `run-<id>.wandb` file: a
    LevelDB-style log of 32 KiB blocks, each record a 7-byte header (crc, length, type) and data)."""
    from wandb.proto import wandb_internal_pb2

    [path] = folder.rglob("run-*.wandb")
    data, records, pending, pos, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item) -> str:
    """An item's name: wandb writes it as `key` or as `nested_key` parts."""
    return item.key or "/".join(item.nested_key)


def _configs(records: list) -> dict[str, str]:
    return {_key(item): item.value_json for record in records if record.WhichOneof("record_type") == "config"
            for item in record.config.update}


def _history(records: list) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                name = _key(item)
                if not name.startswith("_"):
                    series.setdefault(name, []).append((record.history.step.num, float(item.value_json)))
    return series


def test_wandb_offline_through_the_accelerator_and_the_logger(tmp_path):
    pytest.importorskip("wandb")
    _run("""
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from fittrain import Accelerator, Trainer, TrainModule
        from fittrain.callbacks import Logger

        class TinyRegressor(TrainModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)
            def training_step(self, batch):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        acc = Accelerator(cpu=True, log_with="wandb")
        acc.init_trackers("proj", config={"lr": 0.1}, init_kwargs={"wandb": {"name": "direct", "dir": "direct"}})
        acc.log({"loss": 0.5}, step=1)
        acc.log({"loss": 0.25}, step=2)
        assert acc.get_tracker("wandb", unwrap=True).name == "direct"
        acc.end_training()

        torch.manual_seed(0)
        x = torch.randn(16, 4); data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
        logger = Logger(every_n_steps=1, progress_bar=False, log_with="wandb", run_name="trained")
        Trainer(project_dir="project", max_epochs=1, callbacks=[logger]).fit(TinyRegressor(), data)
        """, tmp_path)
    direct = _wandb_records(tmp_path / "direct")
    assert _history(direct)["loss"] == [(1, 0.5), (2, 0.25)]
    [run] = [r.run for r in direct if r.WhichOneof("record_type") == "run"]
    assert run.project == "proj" and run.display_name == "direct"
    assert _configs(direct)["lr"] == "0.1"
    trained = _wandb_records(tmp_path / "project" / "logs" / "trained")  # under the Logger's run folder
    assert [step for step, _ in _history(trained)["train_loss"]] == [1, 2, 3, 4]
    [run] = [r.run for r in trained if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_id, run.display_name) == ("project", "trained", "trained")
    assert _configs(trained)["max_epochs"] == "1"


def test_mlflow_file_store_through_the_accelerator_and_the_logger(tmp_path, monkeypatch, make_regression):
    pytest.importorskip("mlflow")
    for name, value in _offline_env(tmp_path).items():
        if name.startswith("MLFLOW_"):
            monkeypatch.setenv(name, value)
    from mlflow.tracking import MlflowClient

    from fittrain import Accelerator, Trainer
    from fittrain.callbacks import Logger

    uri = f"file://{tmp_path}/mlruns"
    acc = Accelerator(cpu=True, log_with="mlflow")
    acc.init_trackers("exp", config={"lr": 0.1, "opt": {"name": "sgd"}}, init_kwargs={"mlflow": {"logging_dir": uri}})
    acc.log({"loss": 0.5}, step=1)
    acc.log({"loss": 0.25}, step=2)
    run_id = acc.get_tracker("mlflow", unwrap=True).info.run_id
    acc.end_training()
    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1", "opt/name": "sgd"} and run.info.status == "FINISHED"

    module, loader = make_regression()
    Trainer(project_dir=tmp_path / "project", max_epochs=1, callbacks=[
        Logger(every_n_steps=1, progress_bar=False, log_with="mlflow", run_name="trained")]).fit(module, loader)
    [trained] = client.search_runs([client.get_experiment_by_name("project").experiment_id])
    assert trained.info.run_name == "trained" and trained.data.params["max_epochs"] == "1"
    assert [m.step for m in client.get_metric_history(trained.info.run_id, "train_loss")] == [1, 2, 3, 4]


@pytest.fixture
def make_regression():
    """A tiny module and loader (4 batches) for a Trainer run in this process."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fittrain import TrainModule

    class TinyRegressor(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def build():
        torch.manual_seed(0)
        x = torch.randn(16, 4)
        return TinyRegressor(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    return build


def test_a_missing_package_names_the_pip_extra(monkeypatch):
    from fittrain.trackers import registry

    monkeypatch.setattr(registry, "is_available", lambda name: name not in ("wandb", "mlflow"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install fittrain\[wandb\]"):
        registry.resolve_trackers("wandb")
    assert "wandb" not in [spec.name for spec in registry.resolve_trackers("all")]
