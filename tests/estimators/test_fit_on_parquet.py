"""fit_on_parquet: training on Parquet in place (no copy), the errors for columns it cannot read as they are, and
the preparation cache's overwrite exposed as an estimator param."""

from __future__ import annotations

import decimal
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_hvd.data.errors import InconsistentShapeError, TooFewRowsError, UnsupportedColumnTypeError
from spark_hvd.data.parquet import describe_parquet
from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

W = np.array([1.5, -2.0, 0.5], dtype=np.float32)


def _write(path, n: int = 400, files: int = 4, seed: int = 0, **extra) -> np.ndarray:
    """``files`` Parquet files of ``features`` (list<float> of 3) and ``y`` (double) = features . W + 0.3."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = x @ W + 0.3
    os.makedirs(path, exist_ok=True)
    for i, rows in enumerate(np.array_split(np.arange(n), files)):
        cols = {"features": pa.FixedSizeListArray.from_arrays(pa.array(x[rows].reshape(-1)), 3)
                if i % 2 else pa.array(x[rows].tolist(), pa.list_(pa.float32())),
                "y": pa.array(y[rows].astype(np.float64))}
        cols.update({k: v[rows[0]:rows[-1] + 1] for k, v in extra.items()})
        pq.write_table(pa.table(cols), os.path.join(path, f"part-{i}.parquet"))
    return x


def test_describe_reads_types_and_shapes_in_place(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    _write(tmp_path / "t")
    info = describe_parquet(store, f"file://{tmp_path}/t", ["features"], ["y"], num_proc=2)
    assert info.train_path(store) == str(tmp_path / "t") and info.train_rows == 400 and not info.has_validation
    assert info.columns["features"].shape == (3,) and info.columns["features"].dtype == "float32"
    assert info.columns["y"].shape == () and info.columns["y"].dtype == "float64"


@pytest.mark.parametrize("what, match", [
    ("decimal", "price.*decimal: cast it to double"),
    ("vector", "vec.*Spark ML Vector"),
    ("ragged", "ragged.*lengths 2 to 3"),
])
def test_describe_names_the_column_it_cannot_read(tmp_path, what, match):
    store = Store.create(str(tmp_path / "store"))
    n = 40
    extra = {
        "decimal": {"price": pa.array([decimal.Decimal("1.50")] * n, pa.decimal128(5, 2))},
        "vector": {"vec": pa.array([{"type": 1, "size": None, "indices": None, "values": [1.0, 2.0]}] * n)},
        "ragged": {"ragged": pa.array([[1.0, 2.0] if i % 3 else [1.0, 2.0, 3.0] for i in range(n)])},
    }[what]
    _write(tmp_path / "t", n=n, files=1, **extra)
    error = InconsistentShapeError if what == "ragged" else UnsupportedColumnTypeError
    with pytest.raises(error, match=match):
        describe_parquet(store, str(tmp_path / "t"), ["features", next(iter(extra))], ["y"])


def test_describe_needs_a_row_group_per_rank(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    _write(tmp_path / "t", n=30, files=1)
    with pytest.raises(TooFewRowsError, match="1 row groups, fewer than num_proc=2"):
        describe_parquet(store, str(tmp_path / "t"), ["features"], ["y"], num_proc=2)


@pytest.mark.spark
@pytest.mark.slow
def test_fit_on_parquet_trains_without_copying(spark, tmp_path):
    """Two ranks train on the files in place (nothing under the store's data/), the loss falls, and the model's
    transform of the same files equals the trained module called on them."""
    store = Store.create(str(tmp_path / "store"))
    x = _write(tmp_path / "train")
    _write(tmp_path / "val", n=80, files=2, seed=1)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=4,
                         random_seed=1, verbose=0)
    model = est.fit_on_parquet(str(tmp_path / "train"), validation_path=str(tmp_path / "val"))
    hist = model.getHistory()
    assert len(hist["val_loss"]) == 4 and hist["loss"][-1] * 10 <= hist["loss"][0], hist
    assert not store.exists(store.data_root()) or not store.listdir(store.data_root())
    out = model.transform(spark.read.parquet(str(tmp_path / "train"))).collect()
    feats = torch.tensor([r.features for r in out], dtype=torch.float32)
    with torch.no_grad():
        expect = model.getModel()(feats).numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], expect, rtol=1e-5, atol=1e-6)
    assert sorted(map(tuple, feats.numpy().round(5))) == sorted(map(tuple, x.round(5)))


@pytest.mark.spark
def test_fit_on_parquet_rejects_a_validation_fraction(spark, tmp_path):
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "s")), model=net, loss="mse",
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), feature_cols=["features"],
                         label_cols=["y"], validation=0.2)
    with pytest.raises(ValueError, match="validation_path"):
        est.fit_on_parquet(str(tmp_path / "t"))


@pytest.mark.spark
def test_rewritten_files_get_a_new_key_and_overwrite_prepares_again(spark, tmp_path):
    """The cache key sees the source files' sizes and mtimes: files rewritten under the same path are prepared
    again without any setting; overwrite_prepared_data prepares again even when nothing changed."""
    from spark_hvd.data.reader import BatchReader
    from spark_hvd.estimators.fit import _prepare_data

    store = Store.create(str(tmp_path / "store"))
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net, loss="mse", partitions_per_process=1,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), feature_cols=["features"],
                         label_cols=["y"])
    assert est.getOverwritePreparedData() is False

    def labels(info):
        reader = BatchReader.from_dataset(store, info, columns=["y"], rank=0, size=1, batch_size=1000, shuffle=False)
        return np.sort(np.concatenate([b["y"] for b in reader]))

    _write(tmp_path / "t", n=40, files=2, seed=0)
    first_info = _prepare_data(est, spark.read.parquet(str(tmp_path / "t")), store, 2)
    first = labels(first_info)
    again = _prepare_data(est, spark.read.parquet(str(tmp_path / "t")), store, 2)
    assert again.key == first_info.key  # same files, same plan: the cache hits
    _write(tmp_path / "t", n=40, files=2, seed=5)  # last night's path, rewritten with the same schema
    rewritten_info = _prepare_data(est, spark.read.parquet(str(tmp_path / "t")), store, 2)
    assert rewritten_info.key != first_info.key
    rewritten = labels(rewritten_info)
    assert not np.allclose(rewritten, first)  # never stale
    est.setOverwritePreparedData(True)
    np.testing.assert_array_equal(labels(_prepare_data(est, spark.read.parquet(str(tmp_path / "t")), store, 2)),
                                  rewritten)
