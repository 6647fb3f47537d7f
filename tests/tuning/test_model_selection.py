"""Spark ML model selection over distributed fits: TrainValidationSplit and CrossValidator with several grid points
and ``parallelism`` > 1 over TorchEstimator(num_proc=2) on the suite's local[2] session, where two fits do not fit
at once: they take turns for the slots (runner/slot_ledger.py), choose what a sequential run chooses, and the grid
points of a fold share one prepared dataset (before, concurrent fits prepared it each and replaced its files under
the other's readers: FileNotFoundError)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spark_hvd.estimators import TorchEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def blobs(spark):
    rng = np.random.default_rng(5)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
    y = rng.integers(0, 3, 160)
    x = centers[y] + 0.9 * rng.standard_normal((160, 2))
    return spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(160)], "xy array<float>, label int")


def _estimator(store):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3))
    return TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                          loss="cross_entropy", feature_cols=["xy"], label_cols=["label"], batch_size=16, epochs=1,
                          random_seed=1, partitions_per_process=1, verbose=0)


def _evaluator():
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    return MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")


def test_train_validation_split_in_parallel_chooses_as_in_sequence(blobs, tmp_path):
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    out = {}
    for parallelism in (1, 2):
        store = Store.create(str(tmp_path / f"p{parallelism}"))
        est = _estimator(store)
        grid = ParamGridBuilder().addGrid(est.batch_size, [4, 64]).build()
        tvs = TrainValidationSplit(estimator=est, estimatorParamMaps=grid, evaluator=_evaluator(), trainRatio=0.75,
                                   seed=3, parallelism=parallelism)
        model = tvs.fit(blobs)
        out[parallelism] = (model.validationMetrics, model.bestModel.getOrDefault("batch_size"))
        assert len(store.list_datasets()) == 2  # the train split (both grid points) and the final fit's data
    assert out[1][1] == out[2][1]
    np.testing.assert_allclose(out[1][0], out[2][0], rtol=1e-6)


def test_cross_validator_in_parallel_prepares_each_fold_once(blobs, tmp_path):
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    store = Store.create(str(tmp_path / "store"))
    est = _estimator(store)
    grid = ParamGridBuilder().addGrid(est.random_seed, [1, 2]).build()  # the seed is no part of the data's key
    cv = CrossValidator(estimator=est, estimatorParamMaps=grid, evaluator=_evaluator(), numFolds=2, seed=7,
                        parallelism=2)
    model = cv.fit(blobs)
    assert len(model.avgMetrics) == 2 and min(model.avgMetrics) > 0.34
    assert len(store.list_datasets()) == 3  # one per fold, shared by its grid points, and the final fit's
