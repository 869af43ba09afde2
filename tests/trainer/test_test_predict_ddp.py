"""`Trainer.test` and `Trainer.predict` on 2 real gloo processes (scripts/eval_worker.py), on 11
samples: test metrics equal the one-process values (every sample counted once, padding never),
and predict returns every sample once, in dataset order, on both ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.jobs import forked, load_script, run
from support.results import read_results
from support.shared import shared_folder

pytestmark = pytest.mark.subprocess

STAGES = ("unfitted", "fitted")


@pytest.fixture(scope="module")
def worker() -> Any:
    return load_script("eval_worker")


@pytest.fixture(scope="module")
def eval_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = shared_folder(tmp_path_factory, "test_predict",
                        lambda out: run(forked(2, "eval_worker.py", "--out", str(out))).check())
    return read_results(out, 2)


@pytest.fixture(scope="module")
def references(eval_job: list[dict[str, Any]], worker: Any,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """`evaluate` on one process (this one), with the weights the 2-process job evaluated."""
    found = {}
    for stage in STAGES:
        module = worker.Net()
        module.load_state_dict(eval_job[0][stage]["weights"])
        found[stage] = worker.evaluate(worker.Trainer(project_dir=tmp_path_factory.mktemp(stage)), module)
    return found


def _by_hand(worker: Any, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """The test metrics over the whole dataset at once."""
    module = worker.Net()
    module.load_state_dict(weights)
    _, x, y = worker.dataset().tensors
    with torch.no_grad():
        error = module(x) - y
    return {"test_loss": error.pow(2).mean().item(), "test_abs": error.abs().mean().item(),
            "test_logged": x[:, 0].mean().item()}


@pytest.mark.parametrize("stage", STAGES)
def test_both_ranks_evaluated_the_same_weights(eval_job: list[dict[str, Any]], stage: str) -> None:
    assert eval_job[0]["world"] == 2
    for key, value in eval_job[0][stage]["weights"].items():
        assert torch.equal(value, eval_job[1][stage]["weights"][key]), key


@pytest.mark.parametrize("loader", ["batch_size", "batch_sampler", "list", "stream"])
@pytest.mark.parametrize("stage", STAGES)
def test_test_metrics_average_every_sample_once_as_on_one_process(
        eval_job: list[dict[str, Any]], references: dict[str, dict[str, Any]], worker: Any, stage: str,
        loader: str) -> None:
    expected = _by_hand(worker, eval_job[0][stage]["weights"])
    for rank in eval_job:
        metrics = rank[stage][f"test_{loader}"]
        assert metrics == pytest.approx(expected, rel=1e-5)
        assert metrics == pytest.approx(references[stage][f"test_{loader}"], rel=1e-6)
    fallback = eval_job[0][stage]["fallback"]
    assert fallback == pytest.approx({"test_loss": expected["test_loss"]}, rel=1e-5)
    assert eval_job[1][stage]["fallback"] == fallback


@pytest.mark.parametrize("loader", ["batch_size", "batch_sampler", "list", "stream"])
@pytest.mark.parametrize("stage", STAGES)
def test_predict_returns_every_sample_once_in_dataset_order_on_both_ranks(
        eval_job: list[dict[str, Any]], references: dict[str, dict[str, Any]], worker: Any, stage: str,
        loader: str) -> None:
    module = worker.Net()
    module.load_state_dict(eval_job[0][stage]["weights"])
    _, x, _ = worker.dataset().tensors
    with torch.no_grad():
        expected = module(x)
    # By default only the main process keeps the result; all_processes=True gives it to every one.
    assert [rank[stage][f"predict_{loader}_main_only"] for rank in eval_job] == [True, False]
    for rank in eval_job:
        predicted = rank[stage][f"predict_{loader}"]
        assert predicted["index"].tolist() == list(range(worker.N))
        torch.testing.assert_close(predicted["out"], expected)
        torch.testing.assert_close(predicted["out"], references[stage][f"predict_{loader}"]["out"])


@pytest.mark.parametrize("stage", STAGES)
def test_predict_under_bf16_autocast_on_two_ranks(eval_job: list[dict[str, Any]], stage: str) -> None:
    exact = eval_job[0][stage]["predict_batch_size"]
    for rank in eval_job:
        bf16 = rank[stage]["predict_bf16"]
        assert bf16["index"].tolist() == list(range(11))
        assert bf16["out"].dtype == torch.bfloat16  # the Linear ran in bf16: autocast was on
        torch.testing.assert_close(bf16["out"].float(), exact["out"], atol=3e-2, rtol=3e-2)
