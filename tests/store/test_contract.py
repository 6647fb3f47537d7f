"""One contract suite, run against a local directory, memory:// and a real S3 endpoint (moto_server)."""

from __future__ import annotations

import os
import pickle
import posixpath
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from spark_hvd.store import COMMIT_MARKER, RunDir, Store, StoreError


def test_layout_under_prefix(any_store):
    s = any_store
    p = s.prefix_path
    assert s.data_path("k1") == f"{p}/data/k1"
    assert s.train_data_path("k1") == f"{p}/data/k1/train"
    assert s.val_data_path("k1") == f"{p}/data/k1/val"
    assert s.metadata_path("k1") == f"{p}/data/k1/_metadata.json"
    assert s.run_path("r1") == f"{p}/runs/r1"
    assert RunDir(s, "r1").checkpoint_path(3) == f"{p}/runs/r1/checkpoints/epoch-3"
    assert RunDir(s, "r1").logs_path == f"{p}/runs/r1/logs"
    assert RunDir(s, "r1").model_path == f"{p}/runs/r1/model"
    with pytest.raises(ValueError, match="run_id"):
        s.run_path("a/b")


def test_bytes_json_exists_delete(any_store):
    s = any_store
    f = s.path("a", "b", "x.bin")
    assert not s.exists(f)
    payload = os.urandom(1000)
    s.write_bytes(f, payload)
    assert s.exists(f)
    assert s.read_bytes(f) == payload
    s.write_json(s.path("m.json"), {"a": [1, 2]})
    assert s.read_json(s.path("m.json")) == {"a": [1, 2]}
    assert s.listdir(s.path("a")) == ["b"]
    assert s.listdir(s.path("nowhere")) == []
    s.delete(s.path("a"))
    assert not s.exists(f)
    s.delete(s.path("a"))  # deleting twice is fine
    with pytest.raises(FileNotFoundError, match="x.bin"):
        s.read_bytes(f)


def test_list_runs(any_store):
    s = any_store
    assert s.list_runs() == []
    for run in ("run-b", "run-a"):
        s.write_bytes(posixpath.join(RunDir(s, run).logs_path, "metrics.jsonl"), b"{}\n")
    assert s.list_runs() == ["run-a", "run-b"]


def _make_local_dir(root, files):
    for rel, data in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)


def _raw_names(store, path):
    store._invalidate(path)
    try:
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in store.fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def test_atomic_dir_commits_or_leaves_nothing(any_store):
    s = any_store
    final = s.path("things", "d1")
    with s.atomic_dir(final) as target:
        s.write_bytes(posixpath.join(target, "a.txt"), b"A")
        s.write_bytes(posixpath.join(target, "sub", "b.txt"), b"B")
    assert s.is_committed(final)
    assert s.read_bytes(posixpath.join(final, "sub", "b.txt")) == b"B"

    failing = s.path("things", "d2")
    with pytest.raises(RuntimeError, match="boom"), s.atomic_dir(failing) as target:
        s.write_bytes(posixpath.join(target, "a.txt"), b"A")
        raise RuntimeError("boom")
    assert not s.exists(failing)
    assert _raw_names(s, s.path("things")) == ["d1"]  # no temporary directory left behind

    with pytest.raises(StoreError, match="already exists"), s.atomic_dir(final, overwrite=False):
        pass
    with s.atomic_dir(final) as target:  # overwrite replaces the content
        s.write_bytes(posixpath.join(target, "c.txt"), b"C")
    assert s.listdir(final) == sorted([COMMIT_MARKER, "c.txt"])


def test_checkpoints_latest_complete(any_store, tmp_path):
    s = any_store
    run = RunDir(s, "r")
    assert run.latest_checkpoint(str(tmp_path / "none")) is None
    for epoch in (0, 1):
        local = _make_local_dir(tmp_path / f"ck{epoch}", {"model.pt": bytes([epoch]) * 10, "opt/state": b"s"})
        assert run.write_checkpoint(epoch, local) == run.checkpoint_path(epoch)
    # a crashed writer: files of epoch 5 without the commit marker
    s.write_bytes(posixpath.join(run.checkpoint_path(5), "model.pt"), b"partial")
    # a writer that fails midway leaves nothing
    bad = _make_local_dir(tmp_path / "bad", {"model.pt": b"x"})
    with pytest.raises(OSError), s.atomic_dir(run.checkpoint_path(2)) as target:
        s.upload_dir(bad, target)
        raise OSError("disk full")
    assert run.list_checkpoints() == [0, 1]
    found = run.latest_checkpoint(str(tmp_path / "restored"))
    assert found.epoch == 1 and found.path == run.checkpoint_path(1)
    out = found.local_dir
    assert sorted(os.listdir(out)) == ["model.pt", "opt"]
    with open(os.path.join(out, "model.pt"), "rb") as f:
        assert f.read() == bytes([1]) * 10
    assert not s.exists(run.checkpoint_path(5)), "the partial epoch is deleted when the run starts"


def test_pickles_and_works_after(any_store):
    s = any_store
    s.write_bytes(s.path("p.bin"), b"before")
    s._fs  # noqa: B018 - the filesystem is open before pickling
    clone = pickle.loads(pickle.dumps(s))
    assert clone == s and clone._fs is None
    assert clone.read_bytes(clone.path("p.bin")) == b"before"


def test_pyarrow_dataset_round_trip(any_store):
    s = any_store
    fs = s.pyarrow_filesystem()
    table = pa.table({"x": np.arange(100, dtype=np.int64), "v": pa.array([[float(i)] * 3 for i in range(100)])})
    out = s.train_data_path("k")
    s._makedirs(out)
    pq.write_table(table.slice(0, 60), posixpath.join(out, "part-0.parquet"), filesystem=fs, row_group_size=20)
    pq.write_table(table.slice(60), posixpath.join(out, "part-1.parquet"), filesystem=fs, row_group_size=20)
    back = ds.dataset(out, format="parquet", filesystem=fs).to_table().sort_by("x")
    assert back.equals(table)


def test_spark_url(any_store):
    s = any_store
    path = s.train_data_path("k")
    if s.url.startswith("memory://"):
        with pytest.raises(StoreError, match="Spark executors cannot reach"):
            s.spark_url(path)
    elif s.url.startswith("s3://"):
        assert s.spark_url(path) == "s3a://" + path
    elif s.url.startswith("/Volumes/"):
        assert s.spark_url(path) == "dbfs:/Volumes/main/ml/artifacts/store/data/k/train"
    else:
        assert s.spark_url(path) == "file://" + path


def test_create_returns_same_kind(any_store):
    assert type(Store.create(any_store.url, **any_store.storage_options)) is type(any_store)


def test_sharded_reader_reads_through_the_store(any_store):
    """The worker-side read path: spark_hvd's BatchReader over the store's pyarrow filesystem (S3 included)."""
    from spark_hvd.data.reader import BatchReader

    s = any_store
    fs = s.pyarrow_filesystem()
    out = s.train_data_path("k")
    s._makedirs(out)
    ids = np.arange(250, dtype=np.int64)
    for f in range(2):
        part = ids[f * 125 : (f + 1) * 125]
        table = pa.table({"id": part, "v": pa.array([[float(i), -float(i)] for i in part], pa.list_(pa.float32()))})
        pq.write_table(table, posixpath.join(out, f"part-{f}.parquet"), filesystem=fs, row_group_size=30)
    seen = []
    for rank in range(3):
        rd = BatchReader(out, filesystem=fs, rank=rank, size=3, batch_size=16, shuffle=True, seed=1, shapes={"v": (2,)})
        got = [b for b in rd.epoch(0)]
        ids_r = np.concatenate([b["id"] for b in got])[: rd.shard_rows]
        for b in got:
            np.testing.assert_array_equal(b["v"][:, 1], -b["id"].astype(np.float32))
        seen.append(set(ids_r.tolist()))
    assert set().union(*seen) == set(range(250)) and sum(map(len, seen)) == 250


def test_clean_deletes_only_datasets_unused_long_enough(any_store):
    from spark_hvd.store.hygiene import last_used, mark_dataset_used

    for key in ("ds-old", "ds-new", "ds-kept", "ds-unrecorded"):
        with any_store.atomic_dir(any_store.data_path(key)) as target:
            any_store.write_bytes(f"{target}/_metadata.json", b"{}")
    day = 86400.0
    mark_dataset_used(any_store, "ds-old", time.time() - 10 * day)
    mark_dataset_used(any_store, "ds-kept", time.time() - 10 * day)
    mark_dataset_used(any_store, "ds-new", time.time() - 1 * day)
    assert any_store.clean(unused_for_days=7, keep=["ds-kept"], dry_run=True) == ["ds-old"]
    assert any_store.list_datasets() == ["ds-kept", "ds-new", "ds-old", "ds-unrecorded"]
    assert any_store.clean(unused_for_days=7, keep=["ds-kept"]) == ["ds-old"]
    assert any_store.list_datasets() == ["ds-kept", "ds-new", "ds-unrecorded"]
    assert last_used(any_store, "ds-old") is None
    assert last_used(any_store, "ds-unrecorded") is not None  # its clock started at the first clean
    assert any_store.clean(unused_for_days=0, keep=["ds-kept"]) == ["ds-new", "ds-unrecorded"]
    with pytest.raises(ValueError, match="unused_for_days"):
        any_store.clean(unused_for_days=-1)
