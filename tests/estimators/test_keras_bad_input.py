"""KerasEstimator's own bad inputs fail with a clear error before any Spark job runs, the store untouched (what every
estimator shares is in test_params.py)."""

from __future__ import annotations

import keras
import pytest
from helpers.estimators import assert_fit_fails_before_anything_runs

from spark_hvd.estimators import KerasEstimator
from spark_hvd.store import Store

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    return spark.createDataFrame([(Vectors.dense([float(i), 1.0]), float(i), float(i % 2), float(i), i)
                                  for i in range(8)], ["features", "label", "weight", "other", "cls"])


def _model(outputs: int = 1) -> keras.Model:
    inp = keras.Input(shape=(2,))
    outs = [keras.layers.Dense(1, name=f"out{i}")(inp) for i in range(outputs)]
    return keras.Model(inp, outs if outputs > 1 else outs[0])


def _kwargs(store, **kw):
    args = dict(num_proc=2, store=store, model=_model(), optimizer=keras.optimizers.SGD(0.1), loss="mse",
                feature_cols=["features"], label_cols=["label"], batch_size=4, epochs=1, verbose=0)
    args.update(kw)
    return args


class _Torchish:
    """Stands for a model of another framework."""


CASES = [
    ("two losses, one label", dict(loss=["mse", "mae"]), ValueError, r"2 losses for 1 label columns"),
    ("unknown loss name", dict(loss="msee"), ValueError, r"unknown loss name 'msee'"),
    ("no loss", dict(loss=None), ValueError, r"set loss"),
    ("unknown metric", dict(metrics=["acuracy"]), ValueError, r"unknown metric name 'acuracy'"),
    ("loss weights", dict(loss_weights=[1.0, 2.0]), ValueError, r"loss_weights has 2 entries for 1"),
    ("outputs vs labels", dict(label_cols=["label", "other"]), ValueError, r"1 outputs for 2 label columns"),
    ("two outputs, one label", dict(model=_model(2)), ValueError, r"2 outputs for 1 label columns"),
    ("not a keras model", dict(model=_Torchish()), TypeError, r"Keras 3 keras.Model, got .*_Torchish"),
    ("unbuilt model", dict(model=keras.Sequential([keras.layers.Dense(1)])), ValueError, r"not built"),
    ("unknown optimizer name", dict(optimizer="adamm"), ValueError, r"unknown optimizer name 'adamm'"),
    ("no optimizer", dict(optimizer=None), ValueError, r"set optimizer"),
    ("foreign optimizer", dict(optimizer=object()), TypeError, r"keras.optimizers.Optimizer"),
    ("checkpoint callback", dict(checkpoint_callback=keras.callbacks.EarlyStopping()), TypeError,
     r"ModelCheckpoint"),
    ("loss class", dict(loss=keras.losses.SparseCategoricalCrossentropy), TypeError,
     r"KerasEstimator: loss is the class keras.losses.SparseCategoricalCrossentropy, not a loss; pass an instance: "
     r"keras.losses.SparseCategoricalCrossentropy\(\)"),
    ("optimizer class", dict(optimizer=keras.optimizers.Adam), TypeError,
     r"KerasEstimator: optimizer is the class keras.optimizers.Adam, not an optimizer; build it: "
     r"optimizer=keras.optimizers.Adam\(learning_rate=1e-3\)"),
]


@pytest.mark.parametrize("what,kwargs,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_anything_runs(spark, df, tmp_path, what, kwargs, exc, match):
    root = tmp_path / "store"
    store = None if kwargs.get("store", 1) is None else Store.create(str(root))
    kwargs = {k: v for k, v in kwargs.items() if k != "store"}
    est = KerasEstimator(**_kwargs(store, **kwargs))
    assert_fit_fails_before_anything_runs(spark, est, df, root, what, exc, match)


def test_optimizer_by_name_passes_the_checks(spark, df, tmp_path):
    root = tmp_path / "store"
    est = KerasEstimator(**_kwargs(Store.create(str(root)), optimizer="adam", loss="mean_squared_error",
                                   metrics=["accuracy", keras.metrics.MeanAbsoluteError()]))
    plan = est._check(df)
    assert plan["num_proc"] == 2 and est._optimizer_spec == {"name": "adam"}
    assert not root.exists() or not any(root.rglob("*")), "the checks wrote to the store"


def test_params_spark_style_and_copy():
    est = KerasEstimator(batch_size=16, custom_objects={"x": 1})
    assert est.getBatchSize() == 16 and est.getCustomObjects() == {"x": 1}
    text = est.explainParams()
    for name in ("custom_objects", "checkpoint_callback", "loss_weights", "mlflow", "store"):
        assert name in text
    assert est.copy({est.epochs: 3}).getEpochs() == 3 and est.getEpochs() == 1


def _dense(inputs: tuple, width: int) -> keras.Model:
    inp = keras.Input(shape=inputs)
    return keras.Model(inp, keras.layers.Dense(width)(keras.layers.Flatten()(inp)))


PREFLIGHT = [
    ("too few logits", dict(model=(2,), out=5, loss="sparse_categorical_crossentropy", label_cols=["cls"]),
     r"KerasEstimator: label 'cls' holds class indices up to 7 \(8 classes\) but the model gives 5 values per row; "
     r"a class-index loss needs one logit per class: make the last layer 8 wide"),
    ("regression loss, class outputs", dict(model=(2,), out=3, loss=keras.losses.MeanSquaredError()),
     r"KerasEstimator: label 'label' has 1 value\(s\) per row but the model gives 3; .*"
     r"loss='sparse_categorical_crossentropy'"),
    ("input width", dict(model=(3,), out=1, loss="mse"),
     r"KerasEstimator: feature column 'features' has rows of shape \(2,\) but the model's input expects rows of "
     r"shape \(3,\); give a column of that shape"),
    ("input rank", dict(model=(1, 2), out=1, loss="mse"),
     r"feature column 'features' has rows of shape \(2,\) but the model's input expects rows of shape \(1, 2\); "
     r"add keras.layers.Reshape\(\(1, 2\)\) after the model's Input\(\(2,\)\)"),
]


@pytest.mark.parametrize("what,kw,match", PREFLIGHT, ids=[c[0] for c in PREFLIGHT])
def test_forward_pass_preflight_fails_before_any_rank(spark, df, tmp_path, monkeypatch, what, kw, match):
    """The model called on a few prepared rows on the driver: inputs against the feature columns, outputs against
    the labels and their loss, each error naming the column and both shapes; no rank starts."""
    from spark_hvd.runner.backend import SparkBackend

    def no_rank(*a, **k):
        raise AssertionError("a training rank started")

    monkeypatch.setattr(SparkBackend, "run", no_rank)
    model = _dense(kw.pop("model"), kw.pop("out"))
    est = KerasEstimator(**_kwargs(Store.create(str(tmp_path / "store")), model=model, **kw))
    with pytest.raises(ValueError, match=match):
        est.fit(df)


def test_input_check_takes_the_shapes_keras_adjusts():
    """A scalar column feeds Input(shape=(1,)) and a (n, 1) column feeds Input(shape=()), as Keras itself takes
    them (it adds or drops the trailing 1); anything else is named."""
    import numpy as np

    from spark_hvd.estimators.keras.preflight import _check_keras_inputs

    for shape, rows in (((1,), np.zeros((4,), "float32")), ((), np.zeros((4, 1), "float32")),
                        ((3,), np.zeros((4, 3), "float32"))):
        inp = keras.Input(shape=shape)
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Reshape((-1,))(inp)))
        _check_keras_inputs("KerasEstimator", model, ["x"], [rows])
        assert model(rows).shape == (4, 1)  # Keras takes it too
    inp = keras.Input(shape=(1,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    with pytest.raises(ValueError, match=r"feature column 'x' has rows of shape \(2,\) but the model's input expects "
                                         r"rows of shape \(1,\)"):
        _check_keras_inputs("KerasEstimator", model, ["x"], [np.zeros((4, 2), "float32")])
