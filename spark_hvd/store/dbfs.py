"""A store on Databricks DBFS, through its local FUSE mount (``/dbfs``)."""

from __future__ import annotations

import posixpath
from typing import Any

from spark_hvd.store.base import _poll
from spark_hvd.store.errors import StoreURLError
from spark_hvd.store.local import LocalStore


class DBFSStore(LocalStore):
    """A store under ``dbfs:/path`` or ``/dbfs/path``.

    Python code reads and writes through the FUSE mount (``/dbfs/path``); Spark gets ``dbfs:/path``. Files that Spark
    writes through ``dbfs:`` can take a moment to show up on the mount, so :meth:`wait_until_visible` polls for
    Spark's ``_SUCCESS`` file. The mount cannot rename a directory atomically, so directories are committed with the
    ``_COMMITTED`` marker.

    Storage options:
        fuse_root: where DBFS is mounted (default ``/dbfs``; tests point it at a temporary directory).
        visibility_timeout_s: how long :meth:`wait_until_visible` waits by default (default 120).
    """

    supports_rename = False

    def __init__(self, url: str, **storage_options: Any) -> None:
        options = dict(storage_options)
        fuse_root = str(options.pop("fuse_root", "/dbfs")).rstrip("/")
        timeout = float(options.pop("visibility_timeout_s", 120.0))
        if options:
            raise StoreURLError(f"unknown DBFS storage options {sorted(options)} for {url!r}")
        if url.startswith("dbfs:"):
            rel = url[len("dbfs:") :]
            rel = "/" + rel.lstrip("/")
        elif url == "/dbfs" or url.startswith("/dbfs/"):
            rel = url[len("/dbfs") :] or "/"
        else:
            raise StoreURLError(f"not a DBFS URL: {url!r} (expected dbfs:/path or /dbfs/path)")
        rel = posixpath.normpath(rel)
        if rel.startswith(".."):
            raise StoreURLError(f"DBFS path {url!r} leaves the DBFS root")
        self._rel = rel.rstrip("/") or "/"
        self.fuse_root = fuse_root
        self.visibility_timeout_s = timeout
        super().__init__(fuse_root + (self._rel if self._rel != "/" else ""))
        self.url = "dbfs:" + self._rel
        self.storage_options = dict(storage_options)

    def spark_url(self, path: str) -> str:
        """``dbfs:/...`` for a path under the FUSE mount."""
        root = self.fuse_root
        if path != root and not path.startswith(root + "/"):
            raise StoreURLError(f"{path!r} is not under the DBFS mount {root!r}")
        return "dbfs:" + (path[len(root) :] or "/")

    def wait_until_visible(self, path: str, timeout_s: float | None = None) -> None:
        """Poll the FUSE mount until Spark's ``_SUCCESS`` file under ``path`` is visible."""
        timeout = self.visibility_timeout_s if timeout_s is None else timeout_s
        _poll(lambda: self.exists(posixpath.join(path, "_SUCCESS")), timeout, f"Spark output {path!r} in {self!r}")
