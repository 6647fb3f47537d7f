"""Store.create's scheme table and the URL handling of the DBFS, HDFS and fsspec stores (no live cluster)."""

from __future__ import annotations

import os
import pickle
import re

import pytest

from spark_hvd.store import (
    DBFSStore,
    FsspecStore,
    HDFSStore,
    LocalStore,
    RunDir,
    Store,
    StoreError,
    StoreTimeoutError,
    StoreURLError,
    scheme_of,
)


@pytest.mark.parametrize(
    ("url", "cls", "prefix"),
    [
        ("/tmp/a/b", LocalStore, "/tmp/a/b"),
        ("file:///tmp/a/", LocalStore, "/tmp/a"),
        ("dbfs:/ml/store", DBFSStore, "/dbfs/ml/store"),
        ("/dbfs/ml/store", DBFSStore, "/dbfs/ml/store"),
        ("hdfs://nn.example:9000/user/me/store", HDFSStore, "/user/me/store"),
        ("hdfs:///user/me/store", HDFSStore, "/user/me/store"),
        ("memory://bucket/prefix", FsspecStore, "/bucket/prefix"),
        ("s3://bucket/prefix/", FsspecStore, "bucket/prefix"),
    ],
)
def test_scheme_table(url, cls, prefix):
    store = Store.create(url)
    assert type(store) is cls
    assert store.prefix_path == prefix


def test_relative_local_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = Store.create("rel/store")
    assert store.url == str(tmp_path / "rel" / "store")
    monkeypatch.chdir("/")
    assert pickle.loads(pickle.dumps(store)).prefix_path == str(tmp_path / "rel" / "store")


def test_scheme_of():
    assert scheme_of("relative/path") == ""
    assert scheme_of("C:/windows") == ""
    assert scheme_of("S3://b/p") == "s3"
    assert scheme_of("/dbfs/x") == "dbfs"
    assert scheme_of("/dbfsx/y") == ""


def test_bad_urls():
    with pytest.raises(StoreURLError, match="non-empty"):
        Store.create("")
    with pytest.raises(StoreURLError, match="nosuchproto"):
        Store.create("nosuchproto://x/y")
    with pytest.raises(StoreURLError, match="no storage options"):
        Store.create("/tmp/x", key="k")
    with pytest.raises(StoreURLError, match="unknown HDFS storage options"):
        Store.create("hdfs://nn/x", endpoint_url="http://x")
    with pytest.raises(StoreURLError, match="bucket or directory"):
        Store.create("s3://")


def test_fsspec_options_pass_through():
    store = Store.create("memory://opts/x", skip_instance_cache=True)
    assert store.storage_options == {"skip_instance_cache": True}
    assert "memory" in store.fs.protocol


def test_fsspec_spark_urls():
    gs = FsspecStore.__new__(FsspecStore)  # gcsfs / adlfs are not installed here: only the URL mapping is tested
    gs.protocol, gs.url, gs.storage_options = "gs", "gs://bkt/p", {}
    assert gs.spark_url("bkt/p/data") == "gs://bkt/p/data"
    abfs = FsspecStore.__new__(FsspecStore)
    abfs.protocol, abfs.url, abfs.storage_options = "abfs", "abfs://cont/p", {"account_name": "acct"}
    assert abfs.spark_url("cont/p/data") == "abfss://cont@acct.dfs.core.windows.net/p/data"
    abfs.storage_options = {}
    with pytest.raises(StoreError, match="account_name"):
        abfs.spark_url("cont/p/data")


def test_dbfs_paths_and_marker_commit(tmp_path):
    root = str(tmp_path / "dbfs")
    store = Store.create("dbfs:/ml/store", fuse_root=root, visibility_timeout_s=5)
    assert isinstance(store, DBFSStore) and not store.supports_rename
    assert store.prefix_path == f"{root}/ml/store"
    assert store.url == "dbfs:/ml/store"
    assert store.spark_url(store.train_data_path("k")) == "dbfs:/ml/store/data/k/train"
    with pytest.raises(StoreURLError, match="not under the DBFS mount"):
        store.spark_url("/elsewhere/x")
    with store.atomic_dir(store.data_path("k")) as target:
        assert target == store.data_path("k")  # written in place, committed by marker
        store.write_bytes(os.path.join(target, "f"), b"1")
    assert store.is_committed(store.data_path("k"))
    clone = pickle.loads(pickle.dumps(store))
    assert clone.prefix_path == store.prefix_path and clone.fuse_root == root


def test_dbfs_waits_for_spark_success_file(tmp_path):
    store = Store.create("/dbfs/s", fuse_root=str(tmp_path))
    out = store.train_data_path("k")
    os.makedirs(out)
    with pytest.raises(StoreTimeoutError, match="not visible"):
        store.wait_until_visible(out, timeout_s=0.3)
    open(os.path.join(out, "_SUCCESS"), "w").close()
    store.wait_until_visible(out, timeout_s=0.3)


def test_local_wait_checks_existence(tmp_path):
    store = Store.create(str(tmp_path))
    with pytest.raises(StoreTimeoutError):
        store.wait_until_visible(str(tmp_path / "missing"), timeout_s=0)
    store.wait_until_visible(str(tmp_path))


def test_hdfs_url_and_config(monkeypatch):
    store = Store.create("hdfs://nn.example:9000/user/me/store", user="me", extra_conf={"dfs.replication": 2})
    assert store.url == "hdfs://nn.example:9000/user/me/store"
    assert store.spark_url(RunDir(store, "r").model_path) == "hdfs://nn.example:9000/user/me/store/runs/r/model"
    assert store.pyarrow_kwargs() == {
        "host": "nn.example",
        "port": 9000,
        "user": "me",
        "extra_conf": {"dfs.replication": "2"},
    }
    default = Store.create("hdfs:///user/me/store")
    assert (default.host, default.port) == ("default", 0)
    assert default.spark_url("/user/me/store/data") == "hdfs:///user/me/store/data"
    assert Store.create("hdfs://nn/x").port == 8020

    import pyarrow.fs

    made = {}

    class FakeHadoop:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def move(self, src, dst):
            made["moved"] = (src, dst)

    monkeypatch.setattr(pyarrow.fs, "HadoopFileSystem", FakeHadoop)
    clone = pickle.loads(pickle.dumps(store))
    assert clone._pa_fs is None
    assert isinstance(clone.pyarrow_filesystem(), FakeHadoop)
    assert made["host"] == "nn.example" and made["user"] == "me"
    clone._rename("/a", "/b")
    assert made["moved"] == ("/a", "/b")



def test_unwritable_store_is_named(tmp_path):
    (tmp_path / "a_file").write_bytes(b"")
    local = Store.create(str(tmp_path / "a_file" / "store"))  # under a file: even root cannot write there
    with pytest.raises(StoreError, match=f"the store '{local.url}' is not writable"):
        local.check_writable()
    nobody = Store.create("s3://bucket/x", key="k", secret="s", endpoint_url="http://127.0.0.1:9",  # closed port
                          config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2})
    with pytest.raises(StoreError, match="'s3://bucket/x' is not writable"):
        nobody.check_writable()
    good = Store.create(str(tmp_path / "ok"))
    good.check_writable()
    assert os.listdir(tmp_path / "ok") == []  # the probe is gone


def test_volumes_paths_and_the_mounts_limits(volumes_mount):
    from spark_hvd.store.volumes import VolumesStore

    store = Store.create("/Volumes/main/ml/artifacts/store", fuse_root=volumes_mount)
    assert isinstance(store, VolumesStore) and not store.supports_rename
    assert (store.catalog, store.schema, store.volume) == ("main", "ml", "artifacts")
    assert store.url == "/Volumes/main/ml/artifacts/store"
    assert isinstance(Store.create("dbfs:/Volumes/main/ml/artifacts", fuse_root=volumes_mount), VolumesStore)
    for bad in ("/Volumes/main/ml", "/Volumes/main/ml/artifacts/../../x"):
        with pytest.raises(StoreURLError, match="volume"):
            Store.create(bad, fuse_root=volumes_mount)
    # Databricks Runtime 12.2 LTS and below: refused on the driver (writes might land on ephemeral disks)
    for version, ok in (("12.2", False), ("11.3.x-scala2.12", False), ("13.3", True), ("15.4.x-scala2.12", True),
                        ("client.1.13", True)):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("DATABRICKS_RUNTIME_VERSION", version)
            if ok:
                assert isinstance(Store.create("/Volumes/main/ml/artifacts/s", fuse_root=volumes_mount), VolumesStore)
            else:
                with pytest.raises(StoreURLError, match=f"Runtime 13.3 LTS or above.*runs {re.escape(version)}"):
                    Store.create("/Volumes/main/ml/artifacts/s", fuse_root=volumes_mount)
    # the simulated mount refuses what the local store does (write a temporary file, rename it over) ...
    local = Store.create(volumes_mount + "/Volumes/main/ml/artifacts/plain")
    with pytest.raises(OSError, match="rename is not supported"):
        local.write_bytes(local.path("f"), b"x")
    # ... and the volume store writes, overwrites and commits without renaming or appending
    store.write_bytes(store.path("f"), b"one")
    store.write_bytes(store.path("f"), b"two")
    assert store.read_bytes(store.path("f")) == b"two"
    with store.atomic_dir(store.data_path("k")) as target:
        store.write_bytes(f"{target}/part-0", b"data")
    with store.atomic_dir(store.data_path("k")) as target:  # replaced while committed
        store.write_bytes(f"{target}/part-0", b"new data")
    assert store.is_committed(store.data_path("k"))
    assert store.read_bytes(store.data_path("k") + "/part-0") == b"new data"
