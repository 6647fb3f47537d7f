"""fit_on_parquet: training on Parquet in place (no copy), binary / string / ragged / nested columns described as
fit(df) prepares them, the errors for columns it cannot read as they are, and the preparation cache's overwrite
exposed as an estimator param."""

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
    ("nested", "grid.*lengths 2 to 3 at nesting level 2"),
])
def test_describe_names_the_column_it_cannot_read(tmp_path, what, match):
    store = Store.create(str(tmp_path / "store"))
    n = 40
    extra = {
        "decimal": {"price": pa.array([decimal.Decimal("1.50")] * n, pa.decimal128(5, 2))},
        "vector": {"vec": pa.array([{"type": 1, "size": None, "indices": None, "values": [1.0, 2.0]}] * n)},
        "nested": {"grid": pa.array([[[1.0, 2.0]] * 2 if i % 3 else [[1.0, 2.0, 3.0]] * 2 for i in range(n)])},
    }[what]
    _write(tmp_path / "t", n=n, files=1, **extra)
    error = InconsistentShapeError if what == "nested" else UnsupportedColumnTypeError
    with pytest.raises(error, match=match):
        describe_parquet(store, str(tmp_path / "t"), ["features", next(iter(extra))], ["y"])


def test_binary_string_ragged_and_nested_columns_read_in_place_as_fit_prepares_them(tmp_path):
    """Described with the kinds and shapes fit(df) records (bytes, str, ragged token ids, a 2x3 grid) and read by
    two ranks through the prepared-data reader: the values equal the files', ragged rows padded per batch."""
    from spark_hvd.data.reader import BatchReader

    store = Store.create(str(tmp_path / "store"))
    rng = np.random.default_rng(3)
    n = 40
    cols = {"blob": [rng.bytes(int(rng.integers(0, 300))) for _ in range(n)],
            "text": [f"row {i} – ünïcode" for i in range(n)],
            "ids": [rng.integers(1, 99, size=i % 7).tolist() for i in range(n)],
            "grid": [rng.standard_normal((2, 3)).tolist() for _ in range(n)]}
    types = {"blob": pa.binary(), "text": pa.string(), "ids": pa.list_(pa.int32()),
             "grid": pa.list_(pa.list_(pa.float64()))}
    _write(tmp_path / "t", n=n, files=2, **{k: pa.array(v, types[k]) for k, v in cols.items()})
    info = describe_parquet(store, str(tmp_path / "t"), list(cols), ["y"], num_proc=2)
    got = {c: (s.kind, s.dtype, s.shape) for c, s in info.columns.items()}
    assert got == {"blob": ("binary", "object", ()), "text": ("string", "object", ()),
                   "ids": ("ragged", "int32", (-1,)), "grid": ("array", "float64", (2, 3)),
                   "y": ("scalar", "float64", ())}
    seen = set()
    for rank in range(2):
        for batch in BatchReader.from_dataset(store, info, rank=rank, size=2, batch_size=6).epoch(0):
            assert batch["ids"].shape == (len(batch["y"]), max(batch["ids_length"]))
            for j, i in enumerate(batch["text"].tolist()):
                i = int(i.split()[1])
                seen.add(i)
                assert batch["blob"][j] == cols["blob"][i] and batch["ids_length"][j] == len(cols["ids"][i])
                assert batch["ids"][j].tolist() == cols["ids"][i] + [0] * (batch["ids"].shape[1] - len(cols["ids"][i]))
                np.testing.assert_array_equal(batch["grid"][j], cols["grid"][i])
    assert seen == set(range(n))
    _write(tmp_path / "v", n=10, files=1, ids=pa.array([[1, 2]] * 10, pa.list_(pa.int32())))  # rows that agree
    both = describe_parquet(store, str(tmp_path / "t"), ["ids"], ["y"], validation_path=str(tmp_path / "v"))
    assert both.columns["ids"].kind == "ragged"


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
@pytest.mark.slow
def test_fit_on_parquet_decodes_a_binary_image_column_on_the_ranks(spark, tmp_path):
    """PNG bytes in the user's Parquet, no copy: ImageDecoder on the ranks as in fit(df); the classifier learns
    (which half of the image is bright: chance 0.5) and transform of the same files equals the model called on the
    decoded images."""
    PIL = pytest.importorskip("PIL.Image")
    import io

    from spark_hvd.data.decode import ImageDecoder, decode_images

    rng = np.random.default_rng(7)
    blobs, labels = [], []
    for i in range(160):
        img = rng.integers(0, 60, size=(12, 12), dtype=np.uint8)
        img[:, :6] += np.uint8(150) if i % 2 else np.uint8(0)
        img[:, 6:] += np.uint8(0) if i % 2 else np.uint8(150)
        buf = io.BytesIO()
        PIL.fromarray(img, mode="L").save(buf, format="PNG")
        blobs.append(buf.getvalue())
        labels.append(i % 2)
    os.makedirs(tmp_path / "png")
    for f, rows in enumerate(np.array_split(np.arange(160), 2)):
        pq.write_table(pa.table({"content": pa.array([blobs[i] for i in rows], pa.binary()),
                                 "label": pa.array([labels[i] for i in rows], pa.int64())}),
                       os.path.join(tmp_path / "png", f"part-{f}.parquet"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(144, 2))
    decoder = ImageDecoder("content", size=(12, 12), mode="L")
    store = Store.create(str(tmp_path / "store"))
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                         loss="cross_entropy", metrics=["accuracy"], feature_cols=["content"], label_cols=["label"],
                         batch_size=16, epochs=3, random_seed=1, transformation_fn=decoder, verbose=0)
    model = est.fit_on_parquet(str(tmp_path / "png"))
    assert model.getHistory()["accuracy"][-1] >= 0.9, model.getHistory()
    assert not store.exists(store.data_root()) or not store.listdir(store.data_root())
    out = model.transform(spark.read.parquet(str(tmp_path / "png")).limit(40)).collect()
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(decode_images([r.content for r in out], (12, 12), "L"))).numpy()
    np.testing.assert_allclose(np.array([r.label__output for r in out]), direct, rtol=1e-4, atol=1e-5)


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
    from spark_hvd.estimators.common.fit import _prepare_data

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
