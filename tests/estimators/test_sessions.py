"""Both estimators on a Spark Connect session (Databricks shared / serverless compute): a digits Pipeline fit,
transform, save and load through DataFrame APIs only (``connect_mode`` in tests/conftest.py). The same fit on the
classic session, with the same accuracy bar, is ``test_digits_classification_accuracy`` in test_torch_fit.py and
test_keras_fit.py."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _digits(spark):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    rows = [(x[i].tolist(), int(digits.target[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, "pixels array<float>, digit int"), x, digits.target


def _accuracy(pred, target) -> float:
    return float(np.mean(np.argmax(np.array([r.digit__output for r in pred]), axis=1) == target))


def _fit_save_load(spark, est, tmp_path) -> tuple:
    """Fit ``est`` in a Pipeline on the digits, save the PipelineModel, load it back; (loaded stage, accuracy of
    transform before and after the round trip, in row order)."""
    from pyspark.ml import Pipeline, PipelineModel

    df, _x, target = _digits(spark)
    model = Pipeline(stages=[est]).fit(df)
    before = model.transform(df).collect()  # rows keep the DataFrame's order: one partition per input slice
    path = str(tmp_path / "pipeline")
    model.save(path)
    loaded = PipelineModel.load(path)
    after = loaded.transform(df).collect()
    np.testing.assert_allclose(np.array([r.digit__output for r in after]),
                               np.array([r.digit__output for r in before]), rtol=1e-5, atol=1e-6)
    assert [r.digit for r in before] == target.tolist()
    return loaded.stages[0], _accuracy(before, target)


@pytest.mark.compat
def test_torch_digits_pipeline_on_connect(connect_mode, tmp_path):
    import torch

    from spark_hvd.estimators import TorchEstimator, TorchModel
    from spark_hvd.store import Store

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=1e-2), loss="cross_entropy",
                         metrics=["accuracy"], feature_cols=["pixels"], label_cols=["digit"], batch_size=32,
                         epochs=5, validation=0.2, random_seed=3, partitions_per_process=2, verbose=0)
    stage, accuracy = _fit_save_load(connect_mode, est, tmp_path)
    assert isinstance(stage, TorchModel)
    assert stage.getHistory()["val_accuracy"][-1] >= 0.90, stage.getHistory()
    assert accuracy >= 0.93


def test_keras_digits_pipeline_on_connect(connect_mode, tmp_path):
    keras = pytest.importorskip("keras")

    from spark_hvd.estimators import KerasEstimator, KerasModel
    from spark_hvd.store import Store

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    est = KerasEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
                         optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="sparse_categorical_crossentropy",
                         metrics=["accuracy"], feature_cols=["pixels"], label_cols=["digit"], batch_size=32,
                         epochs=4, validation=0.2, random_seed=3, partitions_per_process=2, verbose=0)
    stage, accuracy = _fit_save_load(connect_mode, est, tmp_path)
    assert isinstance(stage, KerasModel)
    assert stage.getHistory()["val_accuracy"][-1] >= 0.90, stage.getHistory()
    assert accuracy >= 0.93
