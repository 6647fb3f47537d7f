"""KerasEstimator.fit on local[2] (num_proc=2): convergence, accuracy, multi-output, custom layers, Pipelines, resume.

Each fit is a Spark barrier stage; the training ranks are the Spark Python workers (TensorFlow imported once each).
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import keras
import numpy as np
import pytest
from helpers.estimators import EpochRecorder, assert_events_match_history, epochs_begun

from spark_hvd._keras_common import compat as keras_compat
from spark_hvd.estimators import KerasEstimator, KerasModel
from spark_hvd.store import RunDir, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

# the training ranks cannot import this test module: its layers and callbacks travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Scale(keras.layers.Layer):
    """A custom layer (not registered with Keras): loading needs custom_objects."""

    def __init__(self, factor: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


class EpochLog(keras.callbacks.Callback):
    """Every rank logs the epochs it begins; optionally rank 1 dies once mid-epoch (``EpochRecorder``)."""

    def __init__(self, directory: str, kill_at_epoch: int | None = None) -> None:
        super().__init__()
        self.recorder = EpochRecorder(directory, kill_at_epoch)
        self.epoch = -1

    @staticmethod
    def _rank() -> int:
        import spark_hvd.keras as hvd

        return hvd.rank()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.recorder.epoch_begin(self._rank(), epoch)

    def on_train_batch_end(self, batch, logs=None):
        self.recorder.batch_end(self._rank(), self.epoch, batch)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("keras_store")))


@pytest.fixture(scope="module")
def reg_df(spark):
    """512 rows of y = x . w + b (plus a 2-vector target z) with the inputs as separate scalar columns."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    z = np.stack([x[:, 0] - x[:, 1], 0.5 * x[:, 2]], axis=1)
    rows = [(float(a), float(b), float(c), float(t), [float(v) for v in zz])
            for (a, b, c), t, zz in zip(x, y, z, strict=True)]
    return spark.createDataFrame(rows, "a double, b double, c double, y double, z array<float>")


def _linear_with_custom_layer() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input(shape=(3,))
    return keras.Model(inp, Scale(2.0)(keras.layers.Dense(1)(inp)))


def _estimator(store, model, **kw) -> KerasEstimator:
    args = dict(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=0.05),
                loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=3, validation=0.2,
                random_seed=1, partitions_per_process=2, verbose=0, custom_objects={"Scale": Scale})
    args.update(kw)
    return KerasEstimator(**args)


@pytest.mark.compat
def test_pipeline_regression_custom_layer_save_load_transform_resume_mlflow(spark, store, reg_df, tmp_path,
                                                                            mlflow_tracking):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import VectorAssembler

    user_model = _linear_with_custom_layer()
    before = [w.copy() for w in user_model.get_weights()]
    est = _estimator(store, user_model, metrics=["mae"], run_id="keras-resume",
                     callbacks=[EpochLog(str(tmp_path))])
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b", "c"], outputCol="features"), est])
    pipeline.save(str(tmp_path / "pipeline"))  # an unfitted pipeline holding the estimator saves and loads too
    loaded_est = Pipeline.load(str(tmp_path / "pipeline")).getStages()[1]
    assert isinstance(loaded_est, KerasEstimator) and loaded_est.getBatchSize() == 32
    assert isinstance(loaded_est.getOptimizer(), keras.optimizers.SGD)
    assert loaded_est.getOptimizer().get_config()["learning_rate"] == pytest.approx(0.05)
    assert isinstance(loaded_est.getModel().layers[-1], Scale)

    fitted = pipeline.fit(reg_df)
    km = fitted.stages[1]
    assert isinstance(km, KerasModel)
    hist = km.getHistory()
    assert len(hist["loss"]) == 3 and len(hist["val_loss"]) == 3 and "val_mae" in hist
    assert hist["loss"][-1] * 10 <= hist["loss"][0], hist
    assert all(np.array_equal(a, b) for a, b in zip(before, user_model.get_weights(), strict=True)), \
        "the user's model must stay untouched"
    trained = km.getModel()
    assert isinstance(trained.layers[-1], Scale) and type(trained.optimizer).__mro__[0] is keras.optimizers.SGD
    assert epochs_begun(tmp_path, 0) == [0, 1, 2] and epochs_begun(tmp_path, 1) == [0, 1, 2]
    assert RunDir(store, "keras-resume").list_checkpoints() == [0, 1, 2]

    # transform == model.predict on the same rows
    out = fitted.transform(reg_df).select("a", "b", "c", "y__output").collect()
    x = np.array([[r.a, r.b, r.c] for r in out], dtype=np.float32)
    expect = trained.predict(x, verbose=0).reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], expect, rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "model")
    fitted.save(path)
    again = PipelineModel.load(path)
    assert again.stages[1].getHistory() == hist and again.stages[1].getRunId() == "keras-resume"
    assert again.transform(reg_df).select("a", "b", "c", "y__output").collect() == out

    # resume by run_id: a fit to 4 epochs runs only the 4th, starting from the checkpointed weights and history;
    # with mlflow set, params, per-epoch metrics and the model (Keras flavour) go to the tracking URI
    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(reg_df)
    second = _estimator(store, _linear_with_custom_layer(), epochs=4, metrics=["mae"], run_id="keras-resume",
                        callbacks=[EpochLog(str(tmp_path))], mlflow="spark_hvd-keras-test").fit(df)
    assert epochs_begun(tmp_path, 0) == [0, 1, 2, 3], "the second fit continues after the last checkpoint"
    h2 = second.getHistory()
    assert h2["loss"][:3] == hist["loss"] and len(h2["loss"]) == 4
    assert h2["loss"][3] < hist["loss"][0] / 10, "the resumed epoch started from the trained weights"
    assert_events_match_history(store, "keras-resume", h2, tmp_path)  # TensorBoard: one file, every epoch once

    import mlflow

    exp = mlflow.get_experiment_by_name("spark_hvd-keras-test")
    runs = mlflow.search_runs([exp.experiment_id], output_format="list")
    assert len(runs) == 1 and runs[0].data.params["optimizer"] == "SGD"
    history = mlflow.tracking.MlflowClient().get_metric_history(runs[0].info.run_id, "loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(h2["loss"])
    with keras.utils.custom_object_scope({"Scale": Scale}):  # MLflow 2 and 3 resolve the runs:/ URI
        logged = mlflow.keras.load_model(f"runs:/{runs[0].info.run_id}/model")
    np.testing.assert_allclose(logged.predict(x[:5], verbose=0), second.getModel().predict(x[:5], verbose=0),
                               rtol=1e-6)


@pytest.mark.compat
def test_digits_classification_accuracy(spark, store):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    rows = [(x[i].tolist(), int(digits.target[i])) for i in range(len(x))]
    df = spark.createDataFrame(rows, "pixels array<float>, digit int")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    est = KerasEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.Adam(learning_rate=1e-2),
                         loss="sparse_categorical_crossentropy", metrics=["accuracy"], feature_cols=["pixels"],
                         label_cols=["digit"], batch_size=32, epochs=4, validation=0.2, random_seed=3,
                         partitions_per_process=2, verbose=0)
    fitted = est.fit(df)
    hist = fitted.getHistory()
    assert hist["val_accuracy"][-1] >= 0.90, hist
    pred = fitted.transform(df.limit(20)).collect()
    assert len(pred[0].digit__output) == 10  # class probabilities per row: array<float>
    # Spark's classifier columns: the softmax layer's output normalised, and its arg-max as a double
    np.testing.assert_allclose(pred[0].probability.toArray(), np.array(pred[0].digit__output) /
                               np.sum(pred[0].digit__output), rtol=1e-5)
    assert pred[0].prediction == float(np.argmax(pred[0].digit__output))


def test_multi_output_loss_weights_optimizer_by_name_best_only(spark, store, reg_df, tmp_path):
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    keras.utils.set_random_seed(0)
    inp = keras.Input(shape=(3,))
    hidden = keras.layers.Dense(16, activation="tanh")(inp)
    model = keras.Model(inp, [keras.layers.Dense(1, name="y_out")(hidden), keras.layers.Dense(2, name="z_out")(hidden)])
    df = reg_df.selectExpr("array(a, b, c) AS features", "y", "z")
    est = KerasEstimator(num_proc=2, store=store, model=model, optimizer="adam", loss=["mse", "mae"],
                         loss_weights=[1.0, 0.5], metrics=["mae"], feature_cols=["features"], label_cols=["y", "z"],
                         batch_size=16, epochs=3, validation=0.2, random_seed=2, partitions_per_process=2,
                         verbose=0, checkpoint_callback=keras.callbacks.ModelCheckpoint(
                             "unused.keras", monitor="val_loss", save_best_only=True))
    fitted = est.fit(df)
    hist = fitted.getHistory()
    assert hist["loss"][-1] < hist["loss"][0], hist
    logged = {"y_out_mae", "z_out_mae", "val_y_out_mae", "val_z_out_mae"}
    if keras_compat.KERAS_VERSION >= (3, 5):  # Keras logs each output's loss from 3.5 on (3.3: only the total)
        logged |= {"y_out_loss", "z_out_loss", "val_y_out_loss", "val_z_out_loss"}
    assert logged <= set(hist), sorted(hist)
    # best-only: the checkpoints are the epochs where val_loss improved, and the final model is the best one
    val = hist["val_loss"]
    improved = [e for e in range(len(val)) if val[e] < min(val[:e], default=np.inf)]
    assert RunDir(store, fitted.getRunId()).list_checkpoints() == improved
    assert_events_match_history(store, fitted.getRunId(), hist, tmp_path)  # every epoch, checkpointed or not

    out = fitted.setOutputCols(["y_pred", "z_pred"]).transform(df)
    assert out.schema["y_pred"].dataType == DoubleType()
    assert out.schema["z_pred"].dataType == ArrayType(FloatType())
    rows = out.collect()
    x = np.array([r.features for r in rows], dtype=np.float32)
    py, pz = fitted.getModel().predict(x, verbose=0)
    np.testing.assert_allclose([r.y_pred for r in rows], py.reshape(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array([r.z_pred for r in rows]), pz, rtol=1e-5, atol=1e-6)


def test_killed_rank_costs_at_most_its_epoch(spark, store, reg_df, tmp_path):
    from pyspark.ml.feature import VectorAssembler

    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(reg_df)
    est = _estimator(store, _linear_with_custom_layer(), epochs=3, max_retries=1,
                     callbacks=[EpochLog(str(tmp_path), kill_at_epoch=1)])
    fitted = est.fit(df)
    assert os.path.exists(tmp_path / "killed"), "rank 1 was to die in epoch 1"
    # epoch 0 was checkpointed, so the retry began again at epoch 1 (the one that was interrupted)
    assert epochs_begun(tmp_path, 0) == [0, 1, 1, 2]
    hist = fitted.getHistory()
    assert len(hist["loss"]) == 3 and len(hist["val_loss"]) == 3, hist
    assert hist["loss"][-1] < hist["loss"][0], hist
    assert RunDir(store, fitted.getRunId()).list_checkpoints() == [0, 1, 2]
    assert_events_match_history(store, fitted.getRunId(), hist, tmp_path)
