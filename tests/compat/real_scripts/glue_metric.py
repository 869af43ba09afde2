"""A local `evaluate` metric module for `evaluate.load("glue", "mrpc")`, written for these tests.

assets.py copies it to `glue/glue.py` in the scripts' working folder; `evaluate.load("glue", ...)`
then loads it as a local module instead of downloading the Hub's. It reports what the Hub's GLUE
metric reports for MRPC: accuracy and the F1 of the positive class, as floats.
"""

import datasets
import evaluate
import numpy as np


class Glue(evaluate.Metric):
    """GLUE's MRPC metric: accuracy and F1 over integer predictions and references."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name != "mrpc":
            raise KeyError(f"this local GLUE metric knows only the 'mrpc' configuration, not {self.config_name!r}")
        return evaluate.MetricInfo(
            description="Accuracy and F1 for GLUE MRPC (local test module).", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}))

    def _compute(self, predictions, references) -> dict:
        predictions, references = np.asarray(predictions), np.asarray(references)
        true_positives = int(((predictions == 1) & (references == 1)).sum())
        predicted, actual = int((predictions == 1).sum()), int((references == 1).sum())
        f1 = 2 * true_positives / (predicted + actual) if predicted + actual else 0.0
        return {"accuracy": float((predictions == references).mean()), "f1": float(f1)}
