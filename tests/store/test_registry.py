"""The scheme -> store registry: built-in entries, user registrations, lazy imports, and base.py importing none."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from spark_hvd.store import LocalStore, Store, StoreURLError, register_store, registered_schemes, registry


class TaggedStore(LocalStore):
    """A user's store: a local directory behind its own scheme."""

    def __init__(self, url: str, **storage_options) -> None:
        super().__init__(url.split("://", 1)[-1])
        self.url = f"tagged://{self.prefix_path}"


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))


def test_builtin_schemes():
    assert registered_schemes() == {
        "": "spark_hvd.store.local.LocalStore",
        "dbfs": "spark_hvd.store.dbfs.DBFSStore",
        "file": "spark_hvd.store.local.LocalStore",
        "hdfs": "spark_hvd.store.hdfs.HDFSStore",
        "viewfs": "spark_hvd.store.hdfs.HDFSStore",
        "volumes": "spark_hvd.store.volumes.VolumesStore",
    }
    assert registry.store_class("s3").__name__ == "FsspecStore"  # anything else: fsspec


def test_user_store_by_class_and_by_dotted_path(clean_registry, tmp_path):
    register_store("tagged", TaggedStore)
    store = Store.create(f"tagged://{tmp_path}/s")
    assert type(store) is TaggedStore and store.prefix_path == f"{tmp_path}/s"
    store.write_bytes(store.path("f"), b"x")
    assert pickle.loads(pickle.dumps(store)).read_bytes(store.path("f")) == b"x"
    register_store("TAGGED2", f"{__name__}.TaggedStore")
    assert type(Store.create(f"tagged2://{tmp_path}/t")) is TaggedStore


def test_registration_errors(clean_registry):
    with pytest.raises(StoreURLError, match="already registered to spark_hvd.store.local.LocalStore"):
        register_store("file", TaggedStore)
    register_store("file", TaggedStore, clobber=True)
    assert registry.store_class("file") is TaggedStore
    register_store("broken", "no_such_module.Store")
    with pytest.raises(StoreURLError, match="'broken'.*cannot be imported"):
        Store.create("broken://x")
    register_store("notastore", "collections.OrderedDict")
    with pytest.raises(StoreURLError, match="not a Store subclass"):
        Store.create("notastore://x")


def test_base_imports_no_implementation():
    """Nowhere in base.py (module level or inside a function) is a store implementation imported."""
    tree = ast.parse(Path(registry.__file__).with_name("base.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    implementations = {path.rpartition(".")[0] for path in [*registered_schemes().values(), registry.DEFAULT_STORE]}
    assert implementations == {"spark_hvd.store.local", "spark_hvd.store.dbfs", "spark_hvd.store.hdfs",
                               "spark_hvd.store.fsspec_store", "spark_hvd.store.volumes"}
    assert not imported & implementations
