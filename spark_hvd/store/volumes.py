"""A store in a Databricks Unity Catalog volume, through its local mount (``/Volumes/<catalog>/<schema>/<volume>``).

Files in a volume are reached by the same path from Python (a FUSE mount on every node) and from Spark. What the
mount allows matters to a store (docs/stores.md cites where each limit comes from): files are written whole and in
order, and neither appended to nor written at random offsets, and nothing in a volume is renamed or hard-linked.
Databricks documents that volumes need Databricks Runtime 13.3 LTS or above, and that on 12.2 LTS and below writes
to ``/Volumes`` paths may succeed yet land on the cluster's ephemeral disks: so a store on a volume is refused on an
older runtime (``DATABRICKS_RUNTIME_VERSION``), on the driver, before anything is written. So this store

- writes every file in one sequential pass (``write_bytes`` removes an earlier file first instead of writing a
  temporary file and renaming it over the old one, as the local store does);
- commits directories with the ``_COMMITTED`` manifest written last (as on DBFS), never by renaming a
  temporary directory (``supports_rename = False``): a reader sees a checkpoint or dataset only once its
  manifest is there, so a torn copy is never taken for a committed one;
- never opens a file for appending: logs are rewritten whole (the store has no append at all).

A single file rewritten in place (the metrics log) can be read half-written for a moment; everything a run
resumes from is committed by manifest.

Storage options (``spark_hvd.store.fuse``): ``fuse_root``, where ``/Volumes`` lives (default ``/``, the real mount),
and ``visibility_timeout_s``.
"""

from __future__ import annotations

import os
import posixpath
import re

from spark_hvd.store.errors import StoreError, StoreURLError
from spark_hvd.store.fuse import FuseStore
from spark_hvd.store.local import _fsync

__all__ = ["VolumesStore", "is_volume_path"]

_VOLUME = re.compile(r"^(?:dbfs:)?/Volumes/([^/]+)/([^/]+)/([^/]+)(/.*)?$")


def is_volume_path(url: str) -> bool:
    """Whether ``url`` is a Unity Catalog volume path (``/Volumes/...`` or ``dbfs:/Volumes/...``)."""
    return url.startswith(("/Volumes/", "dbfs:/Volumes/")) or url in ("/Volumes", "dbfs:/Volumes")


class VolumesStore(FuseStore):
    """A store under ``/Volumes/<catalog>/<schema>/<volume>/<prefix>`` (see the module docstring)."""

    kind = "Volumes"

    def _mount_path(self, url: str) -> str:
        m = _VOLUME.match(url.rstrip("/"))
        if not m:
            raise StoreURLError(f"not a Unity Catalog volume path: {url!r} (expected "
                                "/Volumes/<catalog>/<schema>/<volume>/<path>)")
        rel = posixpath.normpath("/Volumes/" + "/".join(m.group(1, 2, 3)) + (m.group(4) or ""))
        if not rel.startswith("/Volumes/" + "/".join(m.group(1, 2, 3))):
            raise StoreURLError(f"volume path {url!r} leaves its volume")
        _check_runtime(os.environ.get("DATABRICKS_RUNTIME_VERSION", ""), url)
        self.catalog, self.schema, self.volume = m.group(1, 2, 3)
        return rel

    def _canonical_url(self, rel: str) -> str:
        return rel

    def spark_url(self, path: str) -> str:
        """``dbfs:/Volumes/...`` for a path under the mount (Spark on Unity Catalog compute reads it)."""
        root = self.fuse_root
        if not path.startswith(root + "/Volumes/"):
            raise StoreURLError(f"{path!r} is not under the volume mount {root + '/Volumes'!r}")
        return "dbfs:" + path[len(root):]

    def _rename(self, src: str, dst: str) -> None:
        raise StoreError(f"{self!r}: a Unity Catalog volume cannot rename {src!r} (a store bug: "
                         "supports_rename is False)")

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` in one sequential pass (no temporary file, no rename; an earlier file is removed first)."""
        data = bytes(data)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.lexists(path):
            os.remove(path)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            _fsync(f.fileno())
        self._record(path, data)


#: the first Databricks Runtime on which files written to /Volumes reach the volume (docs/stores.md)
MIN_RUNTIME = (13, 3)


def _check_runtime(version: str, url: str) -> None:
    """Refuse a volume on a Databricks Runtime older than 13.3 LTS (``version`` as ``DATABRICKS_RUNTIME_VERSION``
    gives it, e.g. ``"12.2"`` or ``"14.3.x-scala2.12"``; empty or unparsed: not Databricks, or a newer form)."""
    m = re.match(r"^(\d+)\.(\d+)", version.strip())
    if m and (int(m.group(1)), int(m.group(2))) < MIN_RUNTIME:
        raise StoreURLError(
            f"{url!r}: Unity Catalog volumes need Databricks Runtime 13.3 LTS or above, and this cluster runs "
            f"{version}; on 12.2 LTS and below, files written to /Volumes may land on the cluster's ephemeral disks "
            "instead of the volume (Databricks' documentation, see docs/stores.md). Use a newer runtime, or a dbfs:/ "
            "or object store URL"
        )
