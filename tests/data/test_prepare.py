"""prepare_data on small DataFrames with the session SparkSession: types, split, cache, checks, atomicity."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spark_hvd.data import DatasetInfo, prepare_data
from spark_hvd.data.errors import (
    ColumnNotFoundError,
    EmptyDataFrameError,
    InconsistentShapeError,
    NullValuesError,
    TooFewRowsError,
    UnsupportedColumnTypeError,
    ValidationParamError,
)
from spark_hvd.data.prepare import dataset_key
from spark_hvd.data.reader import BatchReader
from spark_hvd.store import Store, StoreError

N = 60


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    rows = []
    for i in range(N):
        vec = Vectors.dense([i, i + 0.5, -i]) if i % 2 else Vectors.sparse(3, {0: float(i), 1: i + 0.5, 2: -float(i)})
        rows.append((i, float(i) / 10, i % 3 == 0, vec, [i, 2 * i], i % 4 == 0, i % 5, 1.0 + i, f"s{i}"))
    schema = (
        "id long, x double, flag boolean, features vector, arr array<int>, is_val boolean, val_num int, "
        "w double, text string"
    )
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    fields = []
    for part in schema.split(", "):
        name, typ = part.split(" ")
        dtype = VectorUDT() if typ == "vector" else T._parse_datatype_string(typ)
        fields.append(T.StructField(name, dtype, False))
    return spark.createDataFrame(rows, T.StructType(fields)).cache()


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


def read_all(store, info, split, size=1):
    rows = {}
    for r in range(size):
        rd = BatchReader.from_dataset(store, info, split, rank=r, size=size, batch_size=7, shuffle=False)
        for b in rd.epoch(0):
            for j, i in enumerate(b["id"].tolist()):
                rows[i] = {k: v[j] for k, v in b.items()}
    return rows


def test_types_split_metadata_and_round_trip(df, store):
    info = prepare_data(
        df,
        store,
        ["features", "arr", "x", "flag"],
        "id",
        sample_weight_col="w",
        validation=0.25,
        num_proc=2,
        partitions_per_process=3,
        seed=11,
    )
    assert info.key.startswith("ds-") and store.is_committed(store.data_path(info.key))
    cols = info.columns
    assert (cols["features"].dtype, cols["features"].shape, cols["features"].kind) == ("float32", (3,), "vector")
    assert (cols["arr"].dtype, cols["arr"].shape, cols["arr"].kind) == ("int32", (2,), "array")
    assert (cols["x"].dtype, cols["x"].shape) == ("float64", ())
    assert cols["flag"].dtype == "bool" and cols["id"].dtype == "int64" and cols["w"].dtype == "float64"
    assert info.train_rows + info.val_rows == N and 0 < info.val_rows < N
    assert info.extra["label_max"] == {"id": N - 1}  # from the checks' pass (an estimator's class count)
    assert DatasetInfo.load(store, info.key) == info
    assert store.read_json(store.metadata_path(info.key))["train_rows"] == info.train_rows

    import pyarrow.dataset as ds

    frags = list(ds.dataset(info.train_path(store), format="parquet").get_fragments())
    assert sum(f.metadata.num_row_groups for f in frags) >= 2  # at least one per rank

    train, val = read_all(store, info, "train", size=2), read_all(store, info, "val")
    assert len(train) == info.train_rows and len(val) == info.val_rows
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(N))
    for i, row in {**train, **val}.items():
        np.testing.assert_array_equal(row["features"], np.array([i, i + 0.5, -i], dtype=np.float32))
        np.testing.assert_array_equal(row["arr"], [i, 2 * i])
        assert row["flag"] == (i % 3 == 0) and row["w"] == 1.0 + i and row["x"] == pytest.approx(i / 10)


def test_validation_column_bool_and_numeric(df, store):
    info = prepare_data(df, store, "x", "id", validation="is_val")
    assert set(read_all(store, info, "val")) == {i for i in range(N) if i % 4 == 0}
    assert "is_val" not in info.columns
    # a numeric column: rows > 0 are validation (48 of 60 here), counted before anything is written
    with pytest.raises(TooFewRowsError, match="'val_num' leaves 12 training rows, fewer than num_proc=13"):
        prepare_data(df, store, "x", "id", validation="val_num", num_proc=13)
    with pytest.raises(TooFewRowsError, match="'is_val' leaves 15 validation rows, fewer than num_proc=16"):
        prepare_data(df, store, "x", "id", validation="is_val", num_proc=16)
    assert store.list_datasets() == [info.key]


def test_cache_reuses_same_dataframe_and_settings(df, store, monkeypatch):
    info = prepare_data(df, store, ["x"], ["id"], num_proc=2)
    assert info.key == dataset_key(df, ["x"], ["id"], num_proc=2)
    files = sorted(os.listdir(info.train_path(store)))

    def no_write(*a, **k):
        raise AssertionError("a cached preparation must not write")

    monkeypatch.setattr(type(store), "atomic_dir", no_write)
    assert prepare_data(df, store, ["x"], ["id"], num_proc=2) == info
    assert prepare_data(df.select("*"), store, ["x"], ["id"], num_proc=2).key == info.key  # same plan
    monkeypatch.undo()
    assert sorted(os.listdir(info.train_path(store))) == files
    keys = {
        info.key,
        dataset_key(df.filter("id < 50"), ["x"], ["id"], num_proc=2),  # another DataFrame
        dataset_key(df, ["x"], ["id"], num_proc=3),  # other settings
        dataset_key(df, ["x"], ["id"], num_proc=2, validation=0.1),
        dataset_key(df, ["x", "flag"], ["id"], num_proc=2),
        dataset_key(df, ["x"], ["id"], num_proc=2, validation=0.1, seed=5),  # another random split
    }
    assert len(keys) == 6
    # the seed draws only a fractional validation split: without one it keys nothing (a grid over random_seed)
    assert dataset_key(df, ["x"], ["id"], num_proc=2, seed=5) == info.key
    with pytest.raises(TypeError, match="num_porc"):  # a misspelt setting, as prepare_data would refuse it
        dataset_key(df, ["x"], ["id"], num_porc=2)
    assert store.list_datasets() == [info.key]


def test_cache_key_stable_across_vector_assembler_calls(spark, df, store, tmp_path):
    """VectorAssembler.transform makes a new UDF object per call (a new semanticHash), and a new assembler over a
    non-double column (val_num: int) puts its own uid in the plan: the key must not change, while whatever changes
    the data does (the assembler's settings and column order, the files under the source, the rows)."""
    from pyspark.ml.feature import VectorAssembler

    path = str(tmp_path / "src")
    df.select("id", "x", "val_num").write.parquet(path)
    src = spark.read.parquet(path)
    assembler = VectorAssembler(inputCols=["x", "val_num"], outputCol="v")
    first, second = assembler.transform(src), assembler.transform(src)
    assert first.semanticHash() != second.semanticHash()  # why semanticHash alone never hit
    key = dataset_key(first, "v", "id")
    assert dataset_key(second, "v", "id") == key
    keep = VectorAssembler(inputCols=["x", "val_num"], outputCol="v", handleInvalid="keep")
    assert dataset_key(keep.transform(src), "v", "id") != key
    info = prepare_data(first, store, "v", "id")
    assert prepare_data(second, store, "v", "id") == info and store.list_datasets() == [info.key]
    again = VectorAssembler(inputCols=["x", "val_num"], outputCol="v")  # a new instance, a new uid
    assert again.uid != assembler.uid and dataset_key(again.transform(src), "v", "id") == key
    assert prepare_data(again.transform(src), store, "v", "id") == info and store.list_datasets() == [info.key]
    assert dataset_key(VectorAssembler(inputCols=["val_num", "x"], outputCol="v").transform(src), "v", "id") != key

    df.select("id", "x", "val_num").filter("id < 30").write.mode("overwrite").parquet(path)  # rewritten in place
    assert dataset_key(assembler.transform(spark.read.parquet(path)), "v", "id") != key
    rows = spark.createDataFrame([(1, 2.0)], "id long, x double")
    other = spark.createDataFrame([(1, 3.0)], "id long, x double")
    assert dataset_key(rows, "x", "id") != dataset_key(other, "x", "id")
    assert dataset_key(rows, "x", "id") == dataset_key(rows.select("*"), "x", "id")


def nothing_written(store):
    return store.listdir(store.data_root()) == [] and not any(
        n.startswith("._tmp") for n in (os.listdir(store.data_root()) if os.path.isdir(store.data_root()) else [])
    )


def test_missing_column_suggests_closest(df, store):
    with pytest.raises(ColumnNotFoundError, match=r"feature column 'featurs'.*did you mean 'features'"):
        prepare_data(df, store, ["featurs"], "id")
    with pytest.raises(ColumnNotFoundError, match="label column 'labl'"):
        prepare_data(df, store, ["x"], "labl")
    with pytest.raises(ColumnNotFoundError, match="validation column 'is_vall'.*'is_val'"):
        prepare_data(df, store, ["x"], "id", validation="is_vall")
    assert nothing_written(store)


def test_bad_types_and_params(df, store, spark):
    with pytest.raises(UnsupportedColumnTypeError, match="feature column 'm' has type map<string,double>"):
        prepare_data(df.selectExpr("*", "map('a', x) as m"), store, ["x", "m"], "id")
    for bad in (0.0, 1.0, 1.5, -0.1, True):
        with pytest.raises(ValidationParamError, match="validation"):
            prepare_data(df, store, ["x"], "id", validation=bad)
    with pytest.raises(ValidationParamError, match="'text' has type string"):
        prepare_data(df, store, ["x"], "id", validation="text")
    nested = spark.createDataFrame([([["1"]],)], "a array<array<string>>")
    with pytest.raises(UnsupportedColumnTypeError, match="array<array<string>>"):
        prepare_data(nested, store, ["a"])
    assert isinstance(UnsupportedColumnTypeError("c", "t"), ValueError)
    assert nothing_written(store)


def test_data_checks_before_writing(spark, store):
    from pyspark.ml.linalg import Vectors

    with pytest.raises(NullValuesError, match=r"label column 'y': 1 of 3 rows"):
        prepare_data(
            spark.createDataFrame([(1.0, 1.0), (2.0, None), (3.0, 0.0)], "x double, y double"), store, "x", "y"
        )
    ragged = spark.createDataFrame([([[1.0, 2.0]],), ([[1.0]],)], "a array<array<double>>")
    with pytest.raises(InconsistentShapeError, match=r"'a' holds arrays of different lengths at nesting level 2 "
                                                     r"\(1 to 2\)"):
        prepare_data(ragged, store, "a")
    ragged_vectors = spark.createDataFrame([(Vectors.dense([1.0, 2.0]),), (Vectors.dense([1.0]),)], ["v"])
    with pytest.raises(InconsistentShapeError, match=r"'v' holds vectors of different lengths \(1 to 2\)"):
        prepare_data(ragged_vectors, store, "v")
    elem_null = spark.createDataFrame([([1.0, None],), ([1.0, 2.0],)], "a array<double>")
    with pytest.raises(NullValuesError, match="null elements"):
        prepare_data(elem_null, store, "a")
    with pytest.raises(EmptyDataFrameError):
        prepare_data(spark.createDataFrame([], "x double"), store, "x")
    with pytest.raises(TooFewRowsError, match="3 rows, fewer than num_proc=4"):
        prepare_data(spark.createDataFrame([(1.0,), (2.0,), (3.0,)], "x double"), store, "x", num_proc=4)
    assert nothing_written(store)


def test_failed_write_leaves_nothing(df, store, monkeypatch):
    def fail(*a, **k):
        raise OSError("lost the filesystem")

    monkeypatch.setenv("SPARK_HVD_PREPARE_WRITER", "jvm")  # Spark's writer (the workers': test_arrow_write.py)
    monkeypatch.setattr(type(store), "wait_until_visible", fail)
    with pytest.raises(OSError, match="lost the filesystem"):
        prepare_data(df, store, ["x"], "id", validation=0.2)
    assert nothing_written(store)


def test_memory_store_is_refused_clearly(df):
    store = Store.create("memory://prep-test/store")
    with pytest.raises(StoreError, match="Spark executors cannot reach"):
        prepare_data(df, store, ["x"], "id")
    assert store.listdir(store.data_root()) == []


def test_float_columns_written_without_dictionary(spark, store):
    """Float columns (a feature array, a double label) skip Parquet's dictionary, which the writer would keep here
    (two distinct values) and throw away on measured floats after encoding twice; an int column keeps it."""
    import pyarrow.dataset as ds

    rows = [([float(i % 2), 1.0], float(i % 2), i % 3) for i in range(40)]
    sdf = spark.createDataFrame(rows, "f array<float>, y double, k int")
    info = prepare_data(sdf, store, ["f", "k"], "y", num_proc=1, partitions_per_process=1)
    chunks = {}
    for frag in ds.dataset(info.train_path(store), format="parquet").get_fragments():
        group = frag.metadata.row_group(0)
        chunks.update({group.column(j).path_in_schema: group.column(j) for j in range(group.num_columns)})
    assert set(chunks) == {"f.list.element", "y", "k"}
    assert not chunks["f.list.element"].has_dictionary_page and not chunks["y"].has_dictionary_page
    assert chunks["k"].has_dictionary_page
    reader = BatchReader.from_dataset(store, info, "train", rank=0, size=1, batch_size=16, shuffle=False)
    got = [(tuple(f), y, k) for b in reader.epoch(0) for f, y, k in zip(b["f"].tolist(), b["y"].tolist(),
                                                                        b["k"].tolist(), strict=True)]
    assert sorted(got) == sorted((tuple(f), y, k) for f, y, k in rows)
