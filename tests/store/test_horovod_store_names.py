"""Horovod's Store API that its own tests and users' code reach: the DBFS path spellings of ``DBFSLocalStore``
(``matches_dbfs``, ``normalize_path``, ``file:/dbfs``), ``get_full_path`` / ``get_localized_path``, ``get_run_path``,
and an HDFS store given a path without a scheme (Horovod's test_spark.py cases, checked here without Horovod)."""

from __future__ import annotations

import pytest

from spark_hvd.store import DBFSStore, HDFSStore, LocalStore, Store, StoreURLError


@pytest.mark.parametrize("url", ["/dbfs/tmp/a1", "dbfs:/tmp/a1", "file:///dbfs/tmp/a1", "file:/dbfs/tmp/a1"])
def test_every_dbfs_spelling_is_the_same_dbfs_store(url, tmp_path):
    store = Store.create(url, fuse_root=str(tmp_path))
    assert isinstance(store, DBFSStore) and DBFSStore.matches_dbfs(url)
    assert store.url == "dbfs:/tmp/a1" and store.prefix_path == f"{tmp_path}/tmp/a1"
    assert DBFSStore.normalize_path(url) == "/dbfs/tmp/a1"
    assert store.get_full_path(store.path("x")) == "dbfs:/tmp/a1/x"
    assert store.get_localized_path("dbfs:/tmp/a1/x") == f"{tmp_path}/tmp/a1/x"


def test_dbfs_with_two_slashes_names_a_host_and_is_refused():
    assert not DBFSStore.matches_dbfs("dbfs://tmp/a1")
    with pytest.raises(ValueError, match="not a DBFS URL"):
        DBFSStore.normalize_path("dbfs://tmp/a1")
    with pytest.raises(StoreURLError):
        DBFSStore("dbfs://tmp/a1")


@pytest.mark.parametrize(("root", "full"), [
    ("hdfs://namenode01:8020/user/test/output", "hdfs://namenode01:8020"),
    ("hdfs:///user/test/output", "hdfs://"),
    ("/user/test/output", "hdfs://"),  # no scheme: the default namenode, as in Horovod
])
def test_hdfs_full_and_localized_paths(root, full):
    store = HDFSStore(root)
    assert store.prefix_path == "/user/test/output"
    assert store.get_full_path("/output") == full + "/output"
    assert store.get_localized_path(full + "/user/test/output") == "/user/test/output"
    assert store.get_run_path("r1") == store.run_path("r1") == "/user/test/output/runs/r1"
    with pytest.raises(StoreURLError, match="not on the namenode"):
        store.get_localized_path("hdfs://othernode:8020/user/test/output")


def test_hdfs_refuses_another_scheme():
    with pytest.raises(ValueError, match="not an HDFS URL"):
        HDFSStore("file:///user/test/output")


def test_local_full_path_round_trips(tmp_path):
    store = LocalStore(str(tmp_path))
    url = store.get_full_path(store.path("runs", "r1"))
    assert url == f"file://{tmp_path}/runs/r1" and store.get_localized_path(url) == store.path("runs", "r1")
    with pytest.raises(StoreURLError, match="is not a URL of the store"):
        store.get_localized_path("file:///elsewhere/x")
