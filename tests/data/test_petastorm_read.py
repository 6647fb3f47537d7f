"""Reading a dataset written by petastorm itself, without petastorm: its Unischema, every codec, through
``BatchReader`` and ``describe_parquet`` (``fit_on_parquet``). The fixture (tests/data/fixtures/petastorm_small,
made by make_petastorm_fixture.py with petastorm 0.13.1) comes with its rows as petastorm's own ``make_reader``
decoded them; the reader must give back the same values."""

from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.data.parquet import describe_parquet
from spark_hvd.data.petastorm_codecs import _ndarray_matrix, decode_column
from spark_hvd.data.reader import BatchReader
from spark_hvd.data.unischema import UNISCHEMA_KEY, UnischemaError, read_unischema
from spark_hvd.store import Store

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
DATASET = os.path.join(FIXTURES, "petastorm_small")


@pytest.fixture(scope="module")
def expected():
    with np.load(os.path.join(FIXTURES, "petastorm_small_expected.npz")) as z:
        return {k: z[k] for k in z.files}


def _rows_of(readers, epoch=0):
    rows = {}
    for reader in readers:
        for batch in reader.epoch(epoch):
            for i, row_id in enumerate(batch["id"]):
                assert int(row_id) not in rows
                rows[int(row_id)] = {k: v[i] for k, v in batch.items()}
    return rows


def test_unischema_is_read_without_petastorm():
    schema = read_unischema(DATASET)
    assert schema.name == "SmallSchema"
    f = schema.fields
    assert list(f) == ["id", "label", "weight", "name", "matrix", "cmatrix", "image_png", "gray_png", "image_jpeg"]
    assert (f["matrix"].numpy_dtype, f["matrix"].shape, f["matrix"].codec.kind) == (np.float32, (4, 3), "ndarray")
    assert (f["cmatrix"].numpy_dtype, f["cmatrix"].codec.kind) == (np.float64, "compressed_ndarray")
    assert f["image_jpeg"].codec.image_format == "jpeg" and f["image_jpeg"].codec.state["_quality"] == 90
    assert f["gray_png"].shape == (8, 6) and f["image_png"].codec.image_format == "png"
    assert f["id"].codec.kind == "scalar" and f["id"].codec.state["_spark_type"].name == "LongType"
    with pytest.raises(ImportError):
        import petastorm  # noqa: F401 - the point: the test environment has none


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_read_what_petastorm_decodes(expected, shuffle):
    readers = [BatchReader(DATASET, rank=r, size=2, batch_size=7, shuffle=shuffle, seed=3) for r in range(2)]
    assert readers[0].codecs["image_png"] == {"kind": "image", "format": "png", "dtype": "uint8", "shape": [8, 6, 3]}
    rows = _rows_of(readers)
    assert sorted(rows) == list(range(40))
    for name, want in expected.items():
        got = np.stack([rows[i][name] for i in range(40)])
        assert got.shape == want.shape, name
        if name == "image_jpeg":  # JPEG decoders may differ by a level or two (Pillow here, OpenCV in petastorm)
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 2
        elif name == "name":
            assert list(got) == list(want)
        else:
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_ndarray_codec_decodes_a_batch_in_one_step(expected):
    """Same header on every row: one view of the values buffer, equal to np.load row by row."""
    table = pq.read_table(DATASET, columns=["id", "matrix"])
    arr = table.column("matrix").combine_chunks()
    fast = _ndarray_matrix(arr, "float32", (4, 3))
    assert fast is not None
    order = np.argsort(table.column("id").to_numpy())
    np.testing.assert_array_equal(fast[order], expected["matrix"])
    sliced = arr.slice(5, 9)  # a slice starts inside the buffers
    np.testing.assert_array_equal(_ndarray_matrix(sliced, "float32", (4, 3)), fast[5:14])
    with pytest.raises(Exception, match="row 0 decodes to shape \\[4, 3\\], expected \\[3, 4\\]"):
        decode_column({"kind": "ndarray"}, arr, "float32", (3, 4), "matrix", "here")


def test_transformation_fn_sees_decoded_arrays(expected):
    seen = []

    def fn(frame):
        seen.append(type(frame["image_png"].iloc[0]))
        frame["bright"] = [float(img.mean()) for img in frame["image_png"]]
        return frame[["id", "bright"]]

    reader = BatchReader(DATASET, columns=["id", "image_png"], batch_size=10, shuffle=False, transformation_fn=fn,
                         read_ahead_pieces=1)
    got = {int(i): b for batch in reader.epoch(0) for i, b in zip(batch["id"], batch["bright"], strict=True)}
    assert set(seen) == {np.ndarray}
    np.testing.assert_allclose([got[i] for i in range(40)], expected["image_png"].reshape(40, -1).mean(axis=1))


def test_describe_parquet_takes_the_codecs(tmp_path, expected):
    store = Store.create(str(tmp_path / "store"))
    info = describe_parquet(store, DATASET, ["matrix", "image_png"], ["label"], num_proc=2)
    assert info.columns["matrix"].shape == (4, 3) and info.columns["matrix"].kind == "array"
    assert info.columns["image_png"].dtype == "uint8" and info.columns["image_png"].shape == (8, 6, 3)
    assert set(info.extra["codecs"]) == {"matrix", "image_png"}
    reader = BatchReader.from_dataset(store, info, columns=["id", "matrix", "label"], batch_size=40, shuffle=False)
    assert reader.codecs == {"matrix": info.extra["codecs"]["matrix"]}
    (batch,) = list(reader.epoch(0))
    order = np.argsort(batch["id"])
    np.testing.assert_array_equal(batch["matrix"][order], expected["matrix"])
    np.testing.assert_array_equal(batch["label"][order], expected["label"])


def test_a_plain_parquet_directory_has_no_unischema(tmp_path):
    os.makedirs(tmp_path / "d")
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "d" / "part-0.parquet")
    assert read_unischema(str(tmp_path / "d")) is None
    assert BatchReader(str(tmp_path / "d"), batch_size=2).codecs == {}


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > boom.txt",))


def test_a_unischema_that_names_other_globals_is_refused(tmp_path):
    """Nothing but petastorm's, numpy's and pyspark's type names is built: a crafted pickle does not run."""
    target = tmp_path / "ds"
    shutil.copytree(DATASET, target)
    meta = pq.read_schema(target / "_common_metadata")
    bad = meta.with_metadata({**meta.metadata, UNISCHEMA_KEY: pickle.dumps(_Boom())})
    pq.write_metadata(bad, target / "_common_metadata")
    with pytest.raises(UnischemaError, match="posix.system is not part of a petastorm Unischema|system is not part"):
        read_unischema(str(target))
    assert not os.path.exists("boom.txt")
