"""A store on Databricks DBFS, through its local FUSE mount (``/dbfs``)."""

from __future__ import annotations

import posixpath

from spark_hvd.store.errors import StoreURLError
from spark_hvd.store.fuse import FuseStore

#: the spellings of a DBFS path Horovod's ``DBFSLocalStore`` takes, and how many characters to drop to get
#: ``/dbfs/...`` (``dbfs:/x`` -> ``/dbfs/x``, ``file:///dbfs/x`` and ``file:/dbfs/x`` -> ``/dbfs/x``)
_FORMS = (("file:///dbfs/", len("file://")), ("file:/dbfs/", len("file:")), ("/dbfs/", 0))


class DBFSStore(FuseStore):
    """A store under ``dbfs:/path`` or ``/dbfs/path`` (also ``file:/dbfs/path``, ``file:///dbfs/path``).

    Python code reads and writes through the FUSE mount (``/dbfs/path``); Spark gets ``dbfs:/path``. Files that Spark
    writes through ``dbfs:`` can take a moment to show up on the mount, so :meth:`wait_until_visible` polls for
    Spark's ``_SUCCESS`` file. The mount cannot rename a directory atomically, so directories are committed with the
    ``_COMMITTED`` marker. Storage options: ``fuse_root`` (default ``/dbfs``) and ``visibility_timeout_s``
    (``spark_hvd.store.fuse``). Horovod's ``DBFSLocalStore``: its ``matches_dbfs`` and ``normalize_path`` are here.
    """

    kind = "DBFS"
    default_fuse_root = "/dbfs"

    @staticmethod
    def matches_dbfs(url: str) -> bool:
        """Whether ``url`` names a DBFS path (``dbfs:/x``, ``/dbfs/x``, ``file:/dbfs/x``, ``file:///dbfs/x``; not
        ``dbfs://x``, which would name a host), as Horovod's ``DBFSLocalStore.matches_dbfs``."""
        return (url.startswith("dbfs:/") and not url.startswith("dbfs://")) or url.startswith(
            tuple(form for form, _ in _FORMS))

    @staticmethod
    def normalize_path(url: str) -> str:
        """``url`` as a path on the ``/dbfs`` mount (``dbfs:/tmp/a`` -> ``/dbfs/tmp/a``), as Horovod's
        ``DBFSLocalStore.normalize_path``; ``StoreURLError`` (a ``ValueError``) for anything else."""
        if url.startswith("dbfs:/") and not url.startswith("dbfs://"):
            return "/dbfs/" + url[len("dbfs:"):].lstrip("/")
        for form, drop in _FORMS:
            if url.startswith(form):
                return url[drop:]
        if url in ("/dbfs", "dbfs:"):
            return "/dbfs/"
        raise StoreURLError(f"not a DBFS URL: {url!r} (expected dbfs:/path or /dbfs/path, or file:/dbfs/path)")

    def _mount_path(self, url: str) -> str:
        rel = posixpath.normpath(self.normalize_path(url)[len("/dbfs"):] or "/")
        if rel.startswith(".."):
            raise StoreURLError(f"DBFS path {url!r} leaves the DBFS root")
        return rel.rstrip("/") or "/"

    def _canonical_url(self, rel: str) -> str:
        return "dbfs:" + rel

    def spark_url(self, path: str) -> str:
        """``dbfs:/...`` for a path under the FUSE mount."""
        root = self.fuse_root
        if path != root and not path.startswith(root + "/"):
            raise StoreURLError(f"{path!r} is not under the DBFS mount {root!r}")
        return "dbfs:" + (path[len(root) :] or "/")
