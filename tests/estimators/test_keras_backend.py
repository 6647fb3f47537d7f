"""KerasEstimator's ``backend`` param: a two-rank fit on Keras's torch and JAX backends equals one process training
Keras on the same combined batches, transform equals the model called directly, and a bad backend is refused on
the driver before any Spark job runs.

The shared Spark session's Python workers may already run Keras on TensorFlow (earlier tests): the ranks and
transform then run in fresh Python processes (``spark_hvd.runner.fresh``); a callback records the backend the
ranks really trained on. The JAX fit forces the fresh-process path (rank 1 asks for it), whatever the workers
loaded, and a callback shows the training ran in a child of the rank's Spark worker."""

from __future__ import annotations

import importlib.util
import os
import sys

import cloudpickle
import keras
import numpy as np
import pytest
from helpers.estimators import assert_fit_fails_before_anything_runs
from helpers.torch_replay import rank_shards

from spark_hvd.estimators import KerasEstimator
from spark_hvd.estimators.keras import backend as keras_backend
from spark_hvd.store import Store

pytestmark = pytest.mark.spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH, EPOCHS, LR = 16, 2, 0.05


class _BackendProbe(keras.callbacks.Callback):
    """Adds ``on_<backend>`` = 1.0 to every epoch's logs (the history shows what the ranks trained on)."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[f"on_{keras.config.backend()}"] = 1.0


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((192, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3
    return spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(len(x))],
                                 "features array<float>, y double")


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])


def _replay(store, fitted, initial: list[np.ndarray]) -> list[np.ndarray]:
    """One process: Keras's own ``train_on_batch`` on each step's batches of both ranks together, each row weighted
    so that the loss is the mean of the two ranks' batch losses (what averaging their gradients computes)."""
    model = _model()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR), loss="mse")
    shards = rank_shards(store, fitted, seed=1, batch_size=BATCH)
    for epoch in range(EPOCHS):
        for batches in zip(*(s.readers["train"].epoch(epoch) for s in shards), strict=True):  # as KerasBatchDataset
            x = np.concatenate([b["features"] for b in batches])
            y = np.concatenate([np.asarray(b["y"], np.float32).reshape(-1, 1) for b in batches])
            w = np.concatenate([np.full(len(b["y"]), len(x) / (len(batches) * len(b["y"])), np.float32)
                                for b in batches])
            model.train_on_batch(x, y, sample_weight=w)
    return model.get_weights()


class _FreshProbe(keras.callbacks.Callback):
    """Adds ``in_fresh_child`` = 1.0 to the epoch's logs when training runs in a child of the rank's Spark Python
    worker (whose pid ``_rank_forcing_fresh`` left in the environment the child inherits)."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["in_fresh_child"] = float(os.getppid() == int(os.environ["SPARK_HVD_TEST_WORKER_PID"]))
            logs[f"on_{keras.config.backend()}"] = 1.0


def _rank_forcing_fresh(trainer_class, spec):
    """The estimator's rank function with rank 1 alone asking for a fresh process: the ranks decide together, so
    rank 0 (whose history the fit returns) must train in a fresh process too."""
    import spark_hvd.core as core
    from spark_hvd.estimators.keras.rank import train_keras_rank

    os.environ["SPARK_HVD_TEST_WORKER_PID"] = str(os.getpid())
    return train_keras_rank(trainer_class, spec, fresh=core.rank() == 1)


class _FreshKerasEstimator(KerasEstimator):
    _rank_fn = staticmethod(_rank_forcing_fresh)


@pytest.mark.slow
@pytest.mark.parametrize("backend,fresh", [("torch", False), ("jax", True)])
def test_fit_on_a_backend_equals_one_process_and_transform_equals_the_model(spark, df, tmp_path, backend, fresh):
    # on torch the ranks take whichever path the reused Spark workers allow (what they loaded before decides); on
    # JAX rank 1 asks for a fresh process, so the fresh-process path is taken whatever the workers loaded
    store = Store.create(str(tmp_path / "store"))
    model = _model()
    initial = [np.array(w) for w in model.get_weights()]
    est = (_FreshKerasEstimator if fresh else KerasEstimator)(
        num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=LR), loss="mse",
        feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=EPOCHS, random_seed=1,
        partitions_per_process=1, verbose=0, backend=backend, callbacks=[_FreshProbe() if fresh else _BackendProbe()])
    fitted = est.fit(df)
    assert fitted.getHistory()[f"on_{backend}"] == [1.0] * EPOCHS, fitted.getHistory()
    if fresh:
        assert fitted.getHistory()["in_fresh_child"] == [1.0] * EPOCHS, fitted.getHistory()
    assert fitted.getBackend() == backend
    want = _replay(store, fitted, initial)
    for got, expected in zip(fitted.getModel().get_weights(), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(want[0] - initial[0]).max() > 1e-2  # it did train

    rows = fitted.transform(df.limit(40)).collect()
    x = np.array([r.features for r in rows], np.float32)
    direct = np.asarray(fitted.getModel()(x)).ravel()
    np.testing.assert_allclose([r.y__output for r in rows], direct, rtol=1e-5, atol=1e-5)


def test_bad_backend_is_refused_on_the_driver(spark, df, tmp_path, monkeypatch):
    with pytest.raises((TypeError, ValueError), match="backend"):
        KerasEstimator(backend="theano")
    root = tmp_path / "store"
    est = KerasEstimator(num_proc=2, store=Store.create(str(root)), model=_model(), optimizer="sgd", loss="mse",
                         feature_cols=["features"], label_cols=["y"], verbose=0, backend="jax")
    real = importlib.util.find_spec
    monkeypatch.setattr(keras_backend.importlib.util, "find_spec", lambda name, *a: None if name == "jax" else
                        real(name, *a))
    assert_fit_fails_before_anything_runs(spark, est, df, root, "jax not installed", ValueError,
                                          "backend='jax' needs the jax package")
