"""Every common column kind through prepare_data, the store and the reader, compared with the DataFrame's values,
read by two ranks: binary, string, ragged and nested arrays, sparse vectors; maps and structs refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spark_hvd.data import prepare_data
from spark_hvd.data.errors import InconsistentShapeError, NullValuesError, UnsupportedColumnTypeError
from spark_hvd.data.reader import BatchReader, pad_ragged
from spark_hvd.store import Store

N = 48


def _rows():
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(5)
    rows = []
    for i in range(N):
        blob = rng.bytes(int(rng.integers(2_000, 60_000)))  # images of different sizes
        tokens = [int(t) for t in rng.integers(1, 1000, size=i % 9)]  # 0 to 8 ids, some rows empty
        nested = rng.standard_normal((2, 3)).round(3).tolist()
        vec = Vectors.sparse(6, {i % 6: float(i), (i + 3) % 6: -1.5}) if i % 3 else Vectors.dense(rng.random(6))
        rows.append((i, blob, f"row {i} – ünïcode", tokens, nested, vec))
    return rows


@pytest.fixture(scope="module")
def kinds_df(spark):
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    schema = T.StructType([
        T.StructField("id", T.LongType(), False), T.StructField("img", T.BinaryType()),
        T.StructField("text", T.StringType()), T.StructField("tokens", T.ArrayType(T.IntegerType())),
        T.StructField("grid", T.ArrayType(T.ArrayType(T.DoubleType()))), T.StructField("vec", VectorUDT()),
    ])
    rows = _rows()
    return rows, spark.createDataFrame(rows, schema)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("kinds") / "store"))


def _read(store, info, size=2, **kwargs):
    got = {}
    for rank in range(size):
        reader = BatchReader.from_dataset(store, info, rank=rank, size=size, batch_size=5, **kwargs)
        for batch in reader.epoch(0):
            for j, i in enumerate(batch["id"].tolist()):
                if i not in got:  # the epoch's padding rows repeat rows already seen
                    got[i] = {k: v[j].toarray()[0] if hasattr(v, "toarray") else v[j] for k, v in batch.items()}
    return got


@pytest.mark.compat
def test_every_kind_round_trips_across_two_ranks(kinds_df, store):
    rows, df = kinds_df
    info = prepare_data(df, store, ["img", "text", "tokens", "grid", "vec"], "id", num_proc=2,
                        partitions_per_process=2, sparse_vectors="sparse", row_group_bytes=128 << 10)
    kinds = {n: (c.kind, c.dtype, c.shape) for n, c in info.columns.items()}
    assert kinds == {"id": ("scalar", "int64", ()), "img": ("binary", "object", ()),
                     "text": ("string", "object", ()), "tokens": ("ragged", "int32", (-1,)),
                     "grid": ("array", "float64", (2, 3)), "vec": ("sparse", "float32", (6,))}
    for shuffle in (False, True):
        got = _read(store, info, shuffle=shuffle, shuffle_buffer_rows=8)
        assert sorted(got) == list(range(N))
        for i, row in got.items():
            _, blob, text, tokens, grid, vec = rows[i]
            assert isinstance(row["img"], bytes) and row["img"] == blob
            assert isinstance(row["text"], str) and row["text"] == text
            length = int(row["tokens_length"])
            assert length == len(tokens) and row["tokens"][:length].tolist() == tokens
            assert not row["tokens"][length:].any()  # padded with 0
            assert row["grid"].shape == (2, 3) and row["grid"].tolist() == grid
            np.testing.assert_array_equal(row["vec"], vec.toArray().astype(np.float32))
    # transformation_fn gets the DataFrame's own Vectors (Sparse and Dense as they were; transform gives it the same:
    # tests/estimators/test_reader_options_fit.py)
    as_text = _read(store, info, columns=["id", "vec"],
                    transformation_fn=lambda df: df.assign(vec=[repr(v) for v in df["vec"]]))
    assert sorted(as_text) == list(range(N))
    assert {i: row["vec"] for i, row in as_text.items()} == {i: repr(r[5]) for i, r in enumerate(rows)}


    # binary row groups sized by bytes: ~1.5 MB of images in 4 files, row groups of about the asked size
    import pyarrow.dataset as ds

    sizes = [f.metadata.row_group(g).total_byte_size for f in ds.dataset(info.train_path(store)).get_fragments()
             for g in range(f.metadata.num_row_groups)]
    assert len(sizes) >= 8 and max(sizes) < 3 * (128 << 10), sizes

    # ragged: padded per batch to the batch's longest row, or handed over as a list of arrays
    reader = BatchReader.from_dataset(store, info, batch_size=5, shuffle=False)
    for batch in reader.epoch(0):
        lengths = [len(rows[i][3]) for i in batch["id"]]
        assert batch["tokens"].shape == (len(lengths), max(lengths)) and batch["tokens"].dtype == np.int32
        assert batch["tokens_length"].tolist() == lengths
    lists = BatchReader.from_dataset(store, info, batch_size=5, shuffle=False, ragged="list")
    for batch in lists.epoch(0):
        assert "tokens_length" not in batch and batch["tokens"].dtype == object
        assert [t.tolist() for t in batch["tokens"]] == [rows[i][3] for i in batch["id"]]
    padded, lengths = pad_ragged(np.array([np.array([1, 2, 3]), np.array([], int), np.array([4])], dtype=object), -1)
    assert padded.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]] and lengths.tolist() == [3, 0, 1]


@pytest.mark.compat
def test_unsupported_and_bad_values_are_caught_on_the_driver(spark, store):
    maps = spark.createDataFrame([({"a": 1.0}, 1.0)], "m map<string,double>, y double")
    with pytest.raises(UnsupportedColumnTypeError, match=r"feature column 'm' has type map<string,double>.*select"):
        prepare_data(maps, store, ["m"], "y")
    structs = spark.createDataFrame([((1.0, 2.0), 1.0)], "s struct<a:double,b:double>, y double")
    with pytest.raises(UnsupportedColumnTypeError, match="feature column 's' has type struct<a:double,b:double>"):
        prepare_data(structs, store, ["s"], "y")
    strings = spark.createDataFrame([(["a"], 1.0)], "s array<string>, y double")
    with pytest.raises(UnsupportedColumnTypeError, match="'s' has type array<string>"):
        prepare_data(strings, store, ["s"], "y")
    null_bytes = spark.createDataFrame([(b"x", 1.0), (None, 2.0)], "b binary, y double")
    with pytest.raises(NullValuesError, match=r"feature column 'b': 1 of 2 rows"):
        prepare_data(null_bytes, store, ["b"], "y")
    ragged_nested = spark.createDataFrame([([[1.0, 2.0]], 1.0), ([[1.0]], 2.0)], "g array<array<double>>, y double")
    with pytest.raises(InconsistentShapeError, match="'g' holds arrays of different lengths at nesting level 2"):
        prepare_data(ragged_nested, store, ["g"], "y")
    null_inner = spark.createDataFrame([([[1.0], None], 1.0)], "g array<array<double>>, y double")
    with pytest.raises(NullValuesError, match="'g': 1 rows hold arrays with null arrays at nesting level 2"):
        prepare_data(null_inner, store, ["g"], "y")
    assert not os.path.exists(store.data_root()) or store.list_datasets() == [] or all(
        not n.startswith("._tmp") for n in os.listdir(store.data_root()))


def _png_parquet(tmp_path, n=24):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, size=(n, 20, 30, 3), dtype=np.uint8)
    blobs = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    path = str(tmp_path / "images.parquet")
    pq.write_table(pa.table({"id": np.arange(n), "content": pa.array(blobs, pa.binary())}), path, row_group_size=5)
    return path, images


@pytest.mark.parametrize("pool_type", ["thread", "process"])
def test_image_decoder_on_the_reader_pool(tmp_path, pool_type):
    pytest.importorskip("PIL")
    from spark_hvd.data.decode import ImageDecoder

    path, images = _png_parquet(tmp_path)
    decoder = ImageDecoder("content", size=(20, 30), mean=[0.5] * 3, std=[0.25] * 3)  # no resize: exact values
    reader = BatchReader(path, batch_size=7, transformation_fn=decoder, pool_type=pool_type, read_ahead_pieces=2)
    seen = 0
    for batch in reader.epoch(0):
        assert batch["content"].shape == (len(batch["id"]), 3, 20, 30) and batch["content"].dtype == np.float32
        want = (images[batch["id"]].transpose(0, 3, 1, 2) / 255.0 - 0.5) / 0.25
        np.testing.assert_allclose(batch["content"], want, atol=1e-5)
        seen += len(batch["id"])
    assert seen == len(images)
    small = ImageDecoder("content", size=(8, 12), mode="L", channels_last=True)
    batch = next(iter(BatchReader(path, batch_size=4, transformation_fn=small).epoch(0)))
    assert batch["content"].shape == (4, 8, 12, 1) and small.shape == (8, 12, 1)
    assert 0.0 <= batch["content"].min() and batch["content"].max() <= 1.0


def test_collate_fn_runs_per_batch_and_must_return_a_dict(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "text.parquet")
    words = [" ".join(["w"] * (1 + i % 5)) for i in range(30)]
    pq.write_table(pa.table({"id": np.arange(30), "text": words}), path, row_group_size=8)

    def tokenise(batch):
        ids = [np.arange(1, len(t.split()) + 1) for t in batch["text"]]
        padded, lengths = pad_ragged(np.array(ids + [np.zeros(0, int)], dtype=object)[:-1])
        return {"id": batch["id"], "ids": padded, "lengths": lengths}

    for batch in BatchReader(path, batch_size=6, shuffle=True, collate_fn=tokenise).epoch(0):
        assert batch["lengths"].tolist() == [1 + i % 5 for i in batch["id"]]
        assert batch["ids"].shape == (6, max(batch["lengths"]))
    with pytest.raises(Exception, match="collate_fn must return a dict"):
        next(iter(BatchReader(path, batch_size=6, collate_fn=lambda b: [b]).epoch(0)))


def test_transformed_rows_of_one_array_are_taken_whole_else_stacked():
    import pandas as pd

    from spark_hvd.data.columns import frame_to_batch

    a = np.random.default_rng(0).random((6, 3, 2)).astype(np.float32)
    assert frame_to_batch(pd.DataFrame({"x": list(a)}), "t")["x"] is a  # a decoder's list(images): no copy
    t = a.transpose(0, 2, 1)
    for rows, want in ((list(a)[::-1], a[::-1]), (list(a)[:4], a[:4]), (list(t), t), ([r.copy() for r in a], a)):
        got = frame_to_batch(pd.DataFrame({"x": rows}), "t")["x"]
        assert got is not a and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_process_pool_is_kept_across_epochs_until_close(tmp_path):
    """One pool of processes serves every epoch until close; big batches come back through shared memory (views of
    a mapped file, unlinked once mapped; the directory goes with the pool), small ones pickled, equal either way."""
    import mmap

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": np.arange(40)}), path, row_group_size=5)

    def tag(df):  # 8 rows of 40 KiB: 320 KiB per batch, over SHARED_MIN_BYTES
        return df.assign(pid=os.getpid(), wide=[np.full(10240, i, np.float32) for i in df["id"]])

    reader = BatchReader(path, batch_size=8, transformation_fn=tag, pool_type="process", read_ahead_pieces=2)
    batches = [list(reader.epoch(e)) for e in range(2)]
    first, second = ({int(p) for b in bs for p in b["pid"]} for bs in batches)
    workers = set(reader._procs.executor._processes)  # the same pool ran both epochs
    assert first and second and first | second <= workers and os.getpid() not in workers, (first, second, workers)
    shared = reader._procs.shared_dir
    for b in batches[0] + batches[1]:
        np.testing.assert_array_equal(b["wide"], np.repeat(b["id"][:, None].astype(np.float32), 10240, axis=1))
        assert b["wide"].flags.writeable
    if shared is not None:  # /dev/shm here: the batches were mapped from it; once gone, a few files wait for reuse
        assert all(isinstance(getattr(b["wide"].base.base, "obj", None), mmap.mmap) for b in batches[0])
        del b, batches
        assert len(os.listdir(shared)) <= reader._procs.keep
    reader.close()
    assert reader._procs is None and (shared is None or not os.path.exists(shared))
    assert {int(p) for b in reader.epoch(2) for p in b["pid"]}.isdisjoint(workers)  # new workers after close
    reader.close()


def test_a_batch_file_no_array_uses_is_reused_for_a_later_batch(tmp_path):
    """The rank hands a batch's file back once the batch's last array is gone; a worker writes a later batch into
    it (grown if need be); the pool keeps a few such files, unlinks the others, and all of them at shutdown."""
    from spark_hvd.data import process_pool

    batch = {"x": np.arange(1 << 17, dtype=np.float32).reshape(64, -1)}
    freed: list[str] = []
    shared = process_pool.to_shared(batch, str(tmp_path))
    back = process_pool.from_shared(shared, "here", freed.append)
    view = back["x"][3]
    del back
    assert freed == [] and os.listdir(tmp_path) == [os.path.basename(shared.path)]  # a view still uses it
    del view
    assert freed == [shared.path]
    bigger = {"x": np.full((128, 2048), 7, np.float32)}  # 1 MiB: more than the file holds
    again = process_pool.to_shared(bigger, str(tmp_path), reuse=freed[0])
    assert again.path == shared.path and len(os.listdir(tmp_path)) == 1
    np.testing.assert_array_equal(process_pool.from_shared(again, "here")["x"], bigger["x"])
    assert os.listdir(tmp_path) == []

    pool = process_pool.TransformPool(lambda df: df, workers=1)  # no process starts before a batch is submitted
    try:
        files = [os.path.join(pool.shared_dir or str(tmp_path), f"f{i}") for i in range(pool.keep + 2)]
        for f in files:
            open(f, "wb").close()
            pool.recycle(f)
        assert [os.path.exists(f) for f in files] == [True] * pool.keep + [False, False]
    finally:
        pool.shutdown()
    assert pool.shared_dir is None or not os.path.exists(pool.shared_dir)


def test_a_batch_without_room_in_shared_memory_is_pickled(tmp_path, monkeypatch):
    from spark_hvd.data import process_pool

    batch = {"x": np.arange(1 << 17, dtype=np.float32).reshape(64, -1), "s": np.array(["a"] * 64, dtype=object)}
    shared = process_pool.to_shared(batch, str(tmp_path))
    assert isinstance(shared, process_pool.SharedBatch) and len(os.listdir(tmp_path)) == 1
    back = process_pool.from_shared(shared, "here")
    assert list(back) == ["x", "s"] and back["s"] is batch["s"] and os.listdir(tmp_path) == []
    np.testing.assert_array_equal(back["x"], batch["x"])

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert process_pool.to_shared(batch, str(tmp_path)) is batch and os.listdir(tmp_path) == []
    small = {"x": np.zeros(8, np.float32)}
    assert process_pool.to_shared(small, str(tmp_path)) is small


def test_the_auto_pool_is_processes_for_small_images_else_threads(tmp_path):
    from spark_hvd.data.decode import ImageDecoder

    path, _ = _png_parquet(tmp_path, n=6)
    small, big = ImageDecoder("content", size=(32, 32)), ImageDecoder("content", size=(224, 224))
    assert BatchReader(path, transformation_fn=small, pool_type="auto").pool_type == "process"
    assert BatchReader(path, transformation_fn=big, pool_type="auto").pool_type == "thread"
    assert BatchReader(path, transformation_fn=lambda df: df, pool_type="auto").pool_type == "thread"
    assert BatchReader(path, transformation_fn=small).pool_type == "thread"  # the reader's own default
