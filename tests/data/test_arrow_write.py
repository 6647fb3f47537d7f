"""The prepared files written by the Python workers (``arrow_write``) against Spark's writer: the same values,
dtypes, row counts and validation split read back; a failure mid-write leaves nothing in the store."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest

from spark_hvd.data import arrow_write, prepare_data
from spark_hvd.data.reader import BatchReader
from spark_hvd.store import Store

N = 90


def _frame(spark):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T

    rows = [(i, float(i) / 7, i % 3 == 0, i % 5, Vectors.dense([i, -i / 2]) if i % 2 else Vectors.sparse(2, {0: i}),
             [i, 2 * i], list(range(i % 4 + 1)), f"s{i}", bytes([i, 7]), [[float(i), 1.0], [2.0, -float(i)]])
            for i in range(N)]
    fields = [T.StructField(n, t, False) for n, t in (
        ("id", T.LongType()), ("x", T.DoubleType()), ("flag", T.BooleanType()), ("k", T.IntegerType()),
        ("vec", VectorUDT()), ("arr", T.ArrayType(T.IntegerType(), False)),
        ("tokens", T.ArrayType(T.LongType(), False)), ("text", T.StringType()), ("img", T.BinaryType()),
        ("grid", T.ArrayType(T.ArrayType(T.FloatType(), False), False)))]
    return spark.createDataFrame(rows, T.StructType(fields))


def _read(store, info, split):
    rows = {}
    reader = BatchReader.from_dataset(store, info, split, rank=0, size=1, batch_size=16, shuffle=False)
    for b in reader.epoch(0):
        for j, i in enumerate(b["id"].tolist()):
            rows[i] = {k: (v[j], getattr(v, "dtype", None)) for k, v in b.items()}
    return rows


def _files(store, info, split):
    dataset = ds.dataset(info.train_path(store) if split == "train" else info.val_path(store), format="parquet")
    return dataset.schema.remove_metadata(), sorted(dataset.get_fragments(), key=lambda f: f.path)


def test_python_written_files_read_as_spark_written_ones(spark, tmp_path, monkeypatch):
    df = _frame(spark).cache()
    cols = ["vec", "arr", "tokens", "text", "img", "grid", "x", "flag", "k"]
    stores, infos = {}, {}
    for writer in ("jvm", "auto"):
        monkeypatch.setenv("SPARK_HVD_PREPARE_WRITER", writer)
        stores[writer] = Store.create(str(tmp_path / writer))
        assert arrow_write.chosen(stores[writer], [], "snappy") == (writer == "auto")
        infos[writer] = prepare_data(df, stores[writer], cols, "id", validation=0.3, num_proc=2,
                                     partitions_per_process=2, seed=5)
    jvm, py = infos["jvm"], infos["auto"]
    assert py.columns == jvm.columns and py.columns["tokens"].kind == "ragged"
    assert (py.train_rows, py.val_rows) == (jvm.train_rows, jvm.val_rows) and 0 < py.val_rows < N
    for split in ("train", "val"):
        got, want = _read(stores["auto"], py, split), _read(stores["jvm"], jvm, split)
        assert sorted(got) == sorted(want)  # the same rows in each split
        for i in got:
            for name in want[i]:
                g, w = got[i][name], want[i][name]
                assert g[1] == w[1], (name, g[1], w[1])  # dtype
                np.testing.assert_equal(g[0], w[0], err_msg=f"{name} of row {i}")
        schema_py, frags_py = _files(stores["auto"], py, split)
        schema_jvm, frags_jvm = _files(stores["jvm"], jvm, split)
        assert schema_py.equals(schema_jvm)  # names, types, nullability at every depth
        # file by file, the rows Spark's writer put in its file of the same partition, in the same order
        assert [os.path.basename(f.path)[:10] for f in frags_py] == [os.path.basename(f.path)[:10] for f in frags_jvm]
        for f_py, f_jvm in zip(frags_py, frags_jvm, strict=True):
            assert f_py.to_table(columns=["id"])["id"].to_pylist() == f_jvm.to_table(columns=["id"])["id"].to_pylist()
        # Spark's schema in the footer, as Spark's writer records it: spark.read.parquet gives the DataFrame's types
        key = arrow_write.SPARK_SCHEMA_KEY
        assert json.loads(frags_py[0].physical_schema.metadata[key]) == \
            json.loads(frags_jvm[0].physical_schema.metadata[key])

def test_failure_mid_file_deletes_it(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    target = store.path("t")
    store._makedirs(os.path.join(target, "train"))
    writer = arrow_write._Writer(store, target, "snappy", ("x",), 1, ["train"], "{}")  # a row group per batch

    def batches():  # partition 3 in two batches, then partition 4 until the source fails
        for i, part in enumerate((3, 3, 4)):
            yield pa.RecordBatch.from_pydict({"x": [float(i)] * 10, arrow_write.PART_COL: [part] * 10,
                                              arrow_write.SPLIT_COL: [0] * 10})
        raise OSError("the source went away")

    with pytest.raises(OSError, match="went away"):
        list(writer(batches()))
    # partition 3's file is complete (a retry of the task writes it again), partition 4's is gone
    assert os.listdir(os.path.join(target, "train")) == ["part-00003.parquet"]
    assert pa.parquet.read_table(os.path.join(target, "train", "part-00003.parquet")).to_pydict() == \
        {"x": [0.0] * 10 + [1.0] * 10}


def test_failed_write_job_leaves_nothing(spark, tmp_path):
    """A task failing in the write job: prepare_data raises, nothing is left in the store (committed or hidden)."""
    from pyspark.sql import functions as F

    marks = str(tmp_path / "marks")
    os.makedirs(marks)

    @F.udf("double")
    def second_call_fails(i):  # the checks' pass evaluates it once; the write's evaluation raises
        path = os.path.join(marks, str(i))
        if os.path.exists(path):
            raise ValueError(f"row {i} evaluated again")
        open(path, "w").close()
        return float(i)

    store = Store.create(str(tmp_path / "store"))
    df = spark.range(40).select(F.col("id"), second_call_fails("id").alias("x"))
    with pytest.raises(Exception, match="evaluated again"):
        prepare_data(df, store, ["x"], "id", validation=0.25, num_proc=2, partitions_per_process=2)
    root = store.data_root()
    assert not os.path.isdir(root) or os.listdir(root) == []
