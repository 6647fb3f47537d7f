"""Pipelines saved by the flat estimators layout (``fixtures/``, see ``make_saved_pipelines.py``) load with today's
code: the stage class their metadata names (``spark_hvd.estimators.torch.TorchModel``) and the classes their
pickles name by module path (``spark_hvd.estimators.rank_run.EarlyStopping``) are found, and the loaded models
transform as the wrapped network called directly on the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def rows_df(spark):
    saved = json.loads((FIXTURES / "rows.json").read_text())
    return spark.createDataFrame([tuple(r) for r in saved["rows"]], saved["columns"])


def _features(rows_df) -> np.ndarray:
    return np.array([[r.a, r.b, r.c] for r in rows_df.orderBy("a").collect()], dtype=np.float32)


def _predictions(model, rows_df) -> np.ndarray:
    out = model.transform(rows_df).orderBy("a").collect()
    return np.array([r["y__output"] for r in out], dtype=np.float64)


def test_saved_torch_pipeline_model_loads_and_transforms_as_its_network(rows_df):
    import torch
    from pyspark.ml import PipelineModel

    from spark_hvd.estimators import TorchModel

    model = PipelineModel.load(str(FIXTURES / "saved_torch_pipeline"))
    stage = model.stages[1]
    assert type(stage) is TorchModel and stage.getLabelCols() == ["y"] and len(stage.getHistory()["loss"]) == 1
    with torch.no_grad():
        direct = stage.getModel()(torch.from_numpy(_features(rows_df))).numpy()[:, 0]
    got = _predictions(model, rows_df)
    assert got.shape == (64,) and np.allclose(got, direct, rtol=1e-5, atol=1e-6)


def test_saved_keras_pipeline_model_loads_and_transforms_as_its_network(rows_df):
    from pyspark.ml import PipelineModel

    from spark_hvd.estimators import KerasModel

    model = PipelineModel.load(str(FIXTURES / "saved_keras_pipeline"))
    stage = model.stages[1]
    assert type(stage) is KerasModel and stage.getBackend() == "tensorflow"
    direct = np.asarray(stage.getModel()(_features(rows_df)))[:, 0]
    got = _predictions(model, rows_df)
    assert got.shape == (64,) and np.allclose(got, direct, rtol=1e-5, atol=1e-6)


def test_saved_torch_estimator_pipeline_loads_its_pickled_callback(spark):
    from pyspark.ml import Pipeline

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.estimators.torch import EarlyStopping

    est = Pipeline.load(str(FIXTURES / "saved_torch_estimator")).getStages()[1]
    assert type(est) is TorchEstimator and est.getEpochs() == 1 and est.getBatchSize() == 16
    (callback,) = est.getCallbacks()
    assert type(callback) is EarlyStopping  # pickled as spark_hvd.estimators.rank_run.EarlyStopping
    assert (callback.policy.monitor, callback.patience) == ("loss", 2)
    assert est.getOptimizer().param_groups[0]["lr"] == 0.05
    assert {id(p) for p in est.getOptimizer().param_groups[0]["params"]} == {id(p) for p in est.getModel().parameters()}
