"""KerasModel.transform against the model called directly: one trace for any batch size, and use_gpu on a CPU."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from spark_hvd.estimators import KerasModel

pytestmark = pytest.mark.spark


def _net(n_in: int = 4, n_out: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((n_in,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(n_out)(h))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="the traced function is the TensorFlow path")
def test_inference_traced_once_for_any_batch_size():
    """Batches of 7, 3, 50 and 1 rows share one trace (no TensorFlow retracing) and equal the model's own call."""
    import spark_hvd.estimators.keras.inference as km

    net = _net()
    x = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    traced = None
    for n in (7, 3, 50, 1):
        got = KerasModel._predict(net, [x[:n]])[0]
        np.testing.assert_allclose(got, np.asarray(net(x[:n], training=False)), rtol=1e-5, atol=1e-6)
        if traced is None:
            traced = km._INFERENCE_FNS[id(net)][2]  # the function of the first call
        assert km._INFERENCE_FNS[id(net)][2] is traced, f"a new function for a batch of {n} rows"
    assert traced.experimental_get_tracing_count() == 1
    got = KerasModel._predict_batches(net, [x], 16)[0]  # 16, 16, 16, 2 rows: still the one trace
    np.testing.assert_allclose(got, np.asarray(net(x, training=False)), rtol=1e-5, atol=1e-6)
    assert km._INFERENCE_FNS[id(net)][2] is traced and traced.experimental_get_tracing_count() == 1


@pytest.mark.slow  # TensorFlow is imported in each Spark Python worker
def test_transform_with_use_gpu_on_a_cpu_worker(spark):
    """transform equals the model called directly; ``setUseGpu(True)`` with no GPU visible gives the same values."""
    net = _net(n_in=3, n_out=2)
    x = np.random.default_rng(1).standard_normal((45, 3)).astype(np.float32)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(45)], "id long, arr array<float>").repartition(2)
    model = KerasModel(model=net, feature_cols=["arr"], label_cols=["t"], batch_size=8)
    expect = np.asarray(net(x, training=False))
    cpu = np.array([r.t__output for r in sorted(model.transform(df).collect(), key=lambda r: r.id)])
    np.testing.assert_allclose(cpu, expect, rtol=1e-5, atol=1e-6)
    gpu = np.array([r.t__output for r in sorted(model.setUseGpu(True).transform(df).collect(), key=lambda r: r.id)])
    np.testing.assert_allclose(gpu, expect, rtol=1e-4, atol=1e-5)


def test_same_model_same_key_and_bytes(spark):
    """A Keras archive differs on every save (it records the time); the model's key must not, or every transform
    would reload the model (and trace a new function) in every Python worker. Changed weights change it."""
    net = _net()
    model = KerasModel(model=net, feature_cols=["x"], label_cols=["t"])
    key1, _, data1 = model._model_broadcast(spark)
    key2, _, data2 = model._model_broadcast(spark)
    assert key1 == key2 and data1 is data2
    net.set_weights([w + 1.0 for w in net.get_weights()])
    key3, _, data3 = model._model_broadcast(spark)
    assert key3 != key1
    np.testing.assert_allclose(KerasModel._load_for_inference(data3).get_weights()[0], net.get_weights()[0])
