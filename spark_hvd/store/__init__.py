"""Where a job's prepared data, checkpoints, logs and models live: ``Store.create(url, **storage_options)``.

See :mod:`spark_hvd.store.base` for the layout and the contract every store honours.
"""

from spark_hvd.store.base import COMMIT_MARKER, Store, scheme_of
from spark_hvd.store.dbfs import DBFSStore
from spark_hvd.store.errors import StoreError, StoreTimeoutError, StoreURLError
from spark_hvd.store.fsspec_store import FsspecStore
from spark_hvd.store.hdfs import HDFSStore
from spark_hvd.store.local import LocalStore
from spark_hvd.store.registry import register_store, registered_schemes
from spark_hvd.store.run_dir import Checkpoint, RunDir

__all__ = [
    "COMMIT_MARKER",
    "Checkpoint",
    "DBFSStore",
    "FsspecStore",
    "HDFSStore",
    "LocalStore",
    "RunDir",
    "Store",
    "StoreError",
    "StoreTimeoutError",
    "StoreURLError",
    "register_store",
    "registered_schemes",
    "scheme_of",
]
