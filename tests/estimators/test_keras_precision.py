"""KerasEstimator under Keras's ``mixed_float16`` policy: a model built under it trains on two ranks through a
``LossScaleOptimizer`` that ``DistributedOptimizer`` reduces before its inf/nan check (no hang, it converges, the
returned model keeps its policy). The two-rank equality with one process is checked at the binding level
(``tests/bindings/test_keras_mixed_precision.py``)."""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest

from spark_hvd.store import Store

keras = pytest.importorskip("keras")

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the callback travels by value to the ranks


class OptimizerRecorder(keras.callbacks.Callback):
    """Writes, on every rank, the class of the optimizer ``model.fit`` runs with and its loss scale at the end."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def on_train_end(self, logs=None) -> None:
        opt = self.model.optimizer
        scale = float(opt.dynamic_scale) if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None
        with open(os.path.join(self.directory, f"rank{os.environ['SPARK_HVD_RANK']}.txt"), "w") as f:
            f.write(f"{type(opt).__name__} {type(getattr(opt, 'inner_optimizer', opt)).__name__} {scale}")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("keras_precision_store")))


def test_mixed_float16_model_fits_on_two_ranks(spark, store, tmp_path):
    from spark_hvd.estimators import KerasEstimator

    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 4))
    y = x @ np.array([1.0, -0.5, 2.0, 0.3]) + 0.2
    df = spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y, strict=True)],
                               ["features", "y"])
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1, dtype="float32")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    est = KerasEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=0.05),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=4,
                         random_seed=1, partitions_per_process=2, verbose=0,
                         callbacks=[OptimizerRecorder(str(tmp_path))])
    fitted = est.fit(df)
    hist = fitted.getHistory()
    assert len(hist["loss"]) == 4 and hist["loss"][-1] * 2 <= hist["loss"][0], hist
    trained = fitted.getModel()
    assert trained.layers[0].dtype_policy.name == "mixed_float16"
    seen = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(2)]
    assert [s[:2] for s in seen] == [["LossScaleOptimizer", "SGD"]] * 2, seen  # the inner one plain: reduced once
    assert seen[0][2] == seen[1][2], seen  # the same loss scale on both ranks
