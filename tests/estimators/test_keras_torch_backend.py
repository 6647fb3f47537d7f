"""KerasEstimator on Keras's torch backend (KERAS_BACKEND=torch) on a cluster without TensorFlow: fit and transform.

Keras picks its backend once per process, so the fit runs in a fresh Python process with its own local[2] Spark.
A ``tensorflow`` package that raises ImportError comes first on its PYTHONPATH (inherited by Spark's Python
workers, which the script checks): a torch-only cluster, simulated. (With TensorFlow installed, Keras itself
imports it to save a ``.keras`` file even on the torch backend; spark_hvd does not.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import sys

    import keras
    import numpy as np
    from pyspark.sql import SparkSession

    from spark_hvd.estimators import KerasEstimator
    from spark_hvd.store import Store

    assert keras.backend.backend() == "torch"
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())

    def probe(_):
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            return "no tensorflow"
        return "tensorflow"

    assert spark.sparkContext.parallelize([0], 1).map(probe).collect() == ["no tensorflow"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, store=Store.create(sys.argv[1]), model=model,
                         optimizer=keras.optimizers.Adam(learning_rate=0.1), loss="mse", feature_cols=["features"],
                         label_cols=["y"], batch_size=16, epochs=4, validation=0.2, random_seed=1,
                         partitions_per_process=1, verbose=0)
    fitted = est.fit(df)
    hist = fitted.getHistory()
    assert hist["loss"][-1] < hist["loss"][0] and len(hist["val_loss"]) == 4, hist
    rows = fitted.transform(df.limit(20)).collect()
    got = np.array([r.y__output for r in rows])
    expected = np.asarray(fitted.getModel().predict(np.array([r.features for r in rows], np.float32), verbose=0))
    np.testing.assert_allclose(got, expected.ravel(), rtol=1e-5, atol=1e-5)
    assert sys.modules.get("tensorflow") is None
    spark.stop()
    print("KERAS-TORCH-OK", hist["loss"][-1])
""")


def test_keras_estimator_on_the_torch_backend(tmp_path):
    blocker = tmp_path / "no_tf" / "tensorflow"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no TensorFlow on this torch-only cluster')\n")
    path = os.pathsep.join([str(blocker.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "KERAS-TORCH-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
