"""What every estimator shares, checked once for all three: params declared once (constructor = Param defaults),
and bad input failing with a clear error before any training task starts, the store untouched."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers.estimators import assert_fit_fails_before_anything_runs

from spark_hvd.estimators import (
    KerasEstimator,
    KerasModel,
    LightningEstimator,
    LightningModel,
    TorchEstimator,
    TorchModel,
)
from spark_hvd.estimators.common.params import OBJECT_PARAMS
from spark_hvd.store import Store

pytestmark = pytest.mark.spark

STAGES = [TorchEstimator, KerasEstimator, LightningEstimator, TorchModel, KerasModel, LightningModel]


@pytest.mark.parametrize("cls", STAGES, ids=lambda c: c.__name__)
def test_constructor_defaults_are_the_param_defaults(cls):
    stage = cls()
    assert stage._paramMap == {}, "the constructor sets nothing the caller did not give"
    signature = inspect.signature(cls.__init__)
    for name, parameter in signature.parameters.items():
        if parameter.default is not inspect.Parameter.empty:
            assert stage.getOrDefault(name) == parameter.default, name
    for param in stage.params:  # every JSON param has a default; object params may be unset
        assert stage.hasDefault(param) or param.name in OBJECT_PARAMS | {"model", "validation"}, param.name
    given = cls(batch_size=7)
    assert given.getBatchSize() == 7 and given.setParams(batch_size=9) is given and given.getBatchSize() == 9
    with pytest.raises(TypeError, match=r"has no param 'batch_sise'.*did you mean \['batch_size'"):
        cls(batch_sise=3)


def test_model_getters_have_horovods_names():
    model = TorchModel(feature_cols=["f"], label_cols=["y"])
    assert model.getFeatureColumns() == ["f"] and model.getLabelColumns() == ["y"]


def _torch_args(**kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    return dict(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse", **kw)


def _keras_args(**kw):
    import keras

    model = keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(1)])
    return dict(model=model, optimizer="sgd", loss="mse", **kw)


def _lightning_args(**kw):
    import lightning.pytorch as pl

    class Lin(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self(batch["features"]).squeeze(1), batch["label"].float())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return dict(model=Lin(), **kw)


ESTIMATORS = {TorchEstimator: _torch_args, KerasEstimator: _keras_args, LightningEstimator: _lightning_args}


@pytest.fixture(scope="module")
def frames(spark):
    rows = [([float(i), 1.0], float(i), i % 2, float(i % 2)) for i in range(8)]
    schema = "features array<float>, label double, klass int, weight double"
    df = spark.createDataFrame(rows, schema)
    nulls = spark.createDataFrame(rows[:-1] + [([1.0, 2.0], None, 1, 1.0)], schema)
    return {"df": df, "empty": df.limit(0), "nulls": nulls}


CASES = [  # (what, params, which frame, exception, message, whether no Spark job may run at all)
    ("missing feature column", dict(feature_cols=["nope"]), "df", ValueError, r"feature_cols: column 'nope'", True),
    ("misspelt label", dict(label_cols=["lable"]), "df", ValueError, r"did you mean \['label'\]", True),
    ("misspelt weight column", dict(sample_weight_col="wieght"), "df", ValueError, r"sample_weight_col.*'weight'",
     True),
    ("zero batch size", dict(batch_size=0), "df", ValueError, r"batch_size must be a positive integer", True),
    ("negative epochs", dict(epochs=-1), "df", ValueError, r"epochs must be a positive integer, got -1", True),
    ("too many processes", dict(num_proc=3), "df", Exception, r"num_proc=3.*free task slots", True),
    ("bad run id", dict(run_id="../escape"), "df", Exception, r"run_id", True),
    ("no store", dict(store=None), "df", ValueError, r"set store", True),
    # the rows' checks are the preparation's (spark_hvd.data.prepare: DataError, a ValueError naming the column)
    ("empty DataFrame", {}, "empty", ValueError, r"the DataFrame has no rows", False),
    ("null label", {}, "nulls", ValueError, r"null values in used columns \(label column 'label': 1 of 8 rows\)",
     False),
]


@pytest.mark.parametrize("cls", list(ESTIMATORS), ids=lambda c: c.__name__)
@pytest.mark.parametrize("what,params,frame,exc,match,no_job", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_training(spark, frames, tmp_path, cls, what, params, frame, exc, match, no_job):
    root = tmp_path / "store"
    args = dict(num_proc=2, store=Store.create(str(root)), feature_cols=["features"], label_cols=["label"],
                batch_size=4, verbose=0)
    args.update(params)
    est = cls(**ESTIMATORS[cls](**args))
    if no_job:
        assert_fit_fails_before_anything_runs(spark, est, frames[frame], root, what, exc, match)
    else:
        with pytest.raises(exc, match=match):
            est.fit(frames[frame])
        assert not root.exists() or not any(root.rglob("*")), "the store was written to"


@pytest.mark.parametrize("cls,loss", [(TorchEstimator, "cross_entropy"),
                                      (KerasEstimator, "sparse_categorical_crossentropy")])
def test_fractional_labels_for_a_class_index_loss(spark, frames, tmp_path, cls, loss):
    root = tmp_path / "store"
    args = ESTIMATORS[cls](num_proc=2, store=Store.create(str(root)), feature_cols=["features"],
                           label_cols=["weight"], verbose=0)
    est = cls(**{**args, "loss": loss})
    assert_fit_fails_before_anything_runs(spark, est, frames["df"], root, f"float labels {cls.__name__}", ValueError,
                                          r"label column 'weight' is double but its loss takes class indices")


def test_duplicate_output_cols(spark, frames):
    model = TorchModel(model=torch.nn.Linear(2, 1), feature_cols=["features"], output_cols=["p", "p"])
    with pytest.raises(ValueError, match=r"output_cols has duplicate names \['p', 'p'\]"):
        model.transform(frames["df"])
