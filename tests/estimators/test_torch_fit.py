"""TorchEstimator.fit on local[2] (num_proc=2 unless said): convergence, accuracy, Pipelines, resume, retry, MLflow.

Each fit is a Spark barrier stage; the DataFrames are module-scoped so their prepared Parquet is reused.
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import EpochRecorder, assert_events_match_history, epochs_begun

from spark_hvd.estimators import TorchEstimator, TorchModel
from spark_hvd.store import RunDir, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

# the training ranks cannot import this test module: its callbacks travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("estimator_store")))


@pytest.fixture(scope="module")
def reg_df(spark):
    """512 rows of y = x . w + b with the three inputs as separate scalar columns (for a VectorAssembler)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    rows = [(float(a), float(b), float(c), float(t)) for (a, b, c), t in zip(x, y, strict=True)]
    return spark.createDataFrame(rows, ["a", "b", "c", "y"])


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 1))


def _estimator(store, net, **kw) -> TorchEstimator:
    args = dict(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse",
                feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=4, validation=0.2,
                random_seed=1, partitions_per_process=2, verbose=0)
    args.update(kw)
    return TorchEstimator(**args)


@pytest.mark.compat
def test_pipeline_regression_fit_save_load_transform(spark, store, reg_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    net = _linear()
    assembler = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features")
    est = _estimator(store, net, metrics=["mae"])
    pipeline = Pipeline(stages=[assembler, est])
    pipeline.save(str(tmp_path / "pipeline"))  # an unfitted pipeline holding the estimator saves and loads too
    loaded_est = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert isinstance(loaded_est, TorchEstimator) and loaded_est.getBatchSize() == 32
    assert loaded_est.getOptimizer().param_groups[0]["lr"] == 0.1
    assert {id(p) for p in loaded_est.getOptimizer().param_groups[0]["params"]} == \
        {id(p) for p in loaded_est.getModel().parameters()}

    model = pipeline.fit(reg_df)
    tm = model.stages[1]
    # a second fit of a Pipeline on the same data: VectorAssembler's new UDF object must not make a new copy
    datasets = store.list_datasets()
    assert datasets
    Pipeline(stages=[assembler, _estimator(store, _linear(), epochs=1)]).fit(reg_df)
    assert store.list_datasets() == datasets
    assert isinstance(tm, TorchModel)
    hist = tm.getHistory()
    assert len(hist["loss"]) == 4 and len(hist["val_loss"]) == 4 and "val_mae" in hist
    assert hist["loss"][-1] * 10 <= hist["loss"][0], hist
    assert not torch.equal(net[0].weight, tm.getModel()[0].weight), "the user's module must stay untouched"

    # transform == the trained module called directly on the same rows
    out = model.transform(reg_df).select("a", "b", "c", "y__output").collect()
    x = torch.tensor([[r.a, r.b, r.c] for r in out], dtype=torch.float32)
    with torch.no_grad():
        expect = tm.getModel()(x).numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], expect, rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "model")
    model.save(path)
    again = PipelineModel.load(path)
    assert again.stages[1].getHistory() == hist and again.stages[1].getRunId() == tm.getRunId()
    assert again.transform(reg_df).select("a", "b", "c", "y__output").collect() == out
    assert RunDir(store, tm.getRunId()).list_checkpoints() == [0, 1, 2, 3]
    lines = store.read_bytes(f"{RunDir(store, tm.getRunId()).logs_path}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [0, 1, 2, 3]
    assert_events_match_history(store, tm.getRunId(), hist, tmp_path)


@pytest.mark.compat
def test_digits_classification_accuracy(spark, store):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    rows = [(x[i].tolist(), int(digits.target[i])) for i in range(len(x))]
    df = spark.createDataFrame(rows, "pixels array<float>, digit int")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=1e-2),
                         loss="cross_entropy", metrics=["accuracy"], feature_cols=["pixels"], label_cols=["digit"],
                         batch_size=32, epochs=5, validation=0.2, random_seed=3, partitions_per_process=2,
                         verbose=0)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist["val_accuracy"][-1] >= 0.90, hist
    pred = model.transform(df.limit(20)).collect()
    assert len(pred[0].digit__output) == 10  # logits per row: array<float>
    assert pred[0].prediction == float(np.argmax(pred[0].digit__output))  # Spark's classifier columns beside it
    assert abs(sum(pred[0].probability) - 1.0) < 1e-6


def test_cross_validator_over_torch_estimator(spark, store):
    """CrossValidator + MulticlassClassificationEvaluator work on a TorchEstimator as on Spark's classifiers
    (2 folds x 1 grid point + the final fit: three small fits)."""
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    rng = np.random.default_rng(5)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
    y = rng.integers(0, 3, 240)
    x = centers[y] + 0.3 * rng.standard_normal((240, 2))
    df = spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(240)], "xy array<float>, label int")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3))
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.1),
                         loss="cross_entropy", feature_cols=["xy"], label_cols=["label"], batch_size=16, epochs=3,
                         random_seed=1, partitions_per_process=1, verbose=0)
    evaluator = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")
    cv = CrossValidator(estimator=est, estimatorParamMaps=ParamGridBuilder().addGrid(est.epochs, [3]).build(),
                        evaluator=evaluator, numFolds=2, seed=7)
    cv_model = cv.fit(df)
    assert cv_model.avgMetrics[0] >= 0.9, cv_model.avgMetrics
    assert evaluator.evaluate(cv_model.transform(df)) >= 0.9


class _EpochLog:
    """Callback: every rank logs the epochs it begins; optionally rank 1 dies once mid-epoch (``EpochRecorder``)."""

    def __init__(self, directory: str, kill_at_epoch: int | None = None) -> None:
        self.recorder = EpochRecorder(directory, kill_at_epoch)

    def _rank(self) -> int:
        import spark_hvd.torch as hvd

        return hvd.rank()

    def on_epoch_begin(self, epoch: int) -> None:
        self.recorder.epoch_begin(self._rank(), epoch)

    def on_batch_end(self, epoch: int, step: int, loss: float) -> None:
        self.recorder.batch_end(self._rank(), epoch, step)


@pytest.mark.compat
def test_resume_by_run_id_and_mlflow(spark, store, reg_df, tmp_path, mlflow_tracking):
    from pyspark.ml.feature import VectorAssembler

    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(reg_df)
    first = _estimator(store, _linear(), epochs=2, run_id="resume-me", callbacks=[_EpochLog(str(tmp_path))]).fit(df)
    assert epochs_begun(tmp_path) == [0, 1]

    second = _estimator(store, _linear(), epochs=3, run_id="resume-me", callbacks=[_EpochLog(str(tmp_path))],
                        mlflow="spark_hvd-test").fit(df)
    assert epochs_begun(tmp_path) == [0, 1, 2], "the second fit continues after the last checkpoint"
    h1, h2 = first.getHistory(), second.getHistory()
    assert h2["loss"][:2] == h1["loss"][:2] and len(h2["loss"]) == 3
    assert_events_match_history(store, "resume-me", h2, tmp_path)  # one file, every epoch once

    import mlflow

    exp = mlflow.get_experiment_by_name("spark_hvd-test")
    runs = mlflow.search_runs([exp.experiment_id], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["batch_size"] == "32" and run.data.params["optimizer"] == "SGD"
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx(h2["loss"])
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")  # MLflow 2 and 3 resolve it
    x = torch.randn(5, 3)
    torch.testing.assert_close(logged(x), second.getModel()(x))


def test_killed_rank_costs_at_most_its_epoch(spark, store, reg_df, tmp_path):
    from pyspark.ml.feature import VectorAssembler

    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(reg_df)
    est = _estimator(store, _linear(), epochs=3, max_retries=1, callbacks=[_EpochLog(str(tmp_path), kill_at_epoch=1)])
    model = est.fit(df)
    assert os.path.exists(tmp_path / "killed")
    # epoch 0 was checkpointed, so the retry began again at epoch 1 (the one that was interrupted)
    assert epochs_begun(tmp_path) == [0, 1, 1, 2]
    assert len(model.getHistory()["loss"]) == 3
    assert model.getHistory()["loss"][-1] < model.getHistory()["loss"][0]
    assert_events_match_history(store, model.getRunId(), model.getHistory(), tmp_path)
