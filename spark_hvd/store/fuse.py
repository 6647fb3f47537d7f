"""``FuseStore``: a local store on a Databricks FUSE mount (DBFS's ``/dbfs``, Unity Catalog's ``/Volumes``) that Spark
reaches by another URL (``dbfs:/...``); its subclasses say which paths it takes (``DBFSStore``, ``VolumesStore``).

Python code reads and writes through the mount; files that Spark writes can take a moment to show up there, so
:meth:`FuseStore.wait_until_visible` polls for Spark's ``_SUCCESS`` file. A mount cannot rename a directory
atomically, so directories are committed by manifest (``supports_rename = False``).

Storage options (both stores):
    fuse_root: where the mount is (tests point it at a temporary directory).
    visibility_timeout_s: how long :meth:`FuseStore.wait_until_visible` waits by default (default 120).
"""

from __future__ import annotations

import posixpath
from abc import abstractmethod
from typing import Any

from spark_hvd.store.base import _poll, split_layout
from spark_hvd.store.errors import StoreURLError
from spark_hvd.store.local import LocalStore

__all__ = ["FuseStore"]


class FuseStore(LocalStore):
    """A store on a FUSE mount under ``fuse_root`` (see the module docstring)."""

    supports_rename = False
    #: the mount's default ``fuse_root``, and the store's name in messages
    default_fuse_root = "/"
    kind = "FUSE"

    def __init__(self, url: str, **storage_options: Any) -> None:
        options, layout = split_layout(storage_options)
        self.fuse_root = str(options.pop("fuse_root", self.default_fuse_root)).rstrip("/")
        self.visibility_timeout_s = float(options.pop("visibility_timeout_s", 120.0))
        if options:
            raise StoreURLError(f"unknown {self.kind} storage options {sorted(options)} for {url!r}")
        rel = self._mount_path(url)
        super().__init__(self.fuse_root + (rel if rel != "/" else ""))
        self.url = self._canonical_url(rel)
        self.storage_options = {k: v for k, v in storage_options.items() if k not in layout}
        self._place(**layout)

    @abstractmethod
    def _mount_path(self, url: str) -> str:
        """The absolute path under the mount that ``url`` names (``StoreURLError`` if it names none)."""

    @abstractmethod
    def _canonical_url(self, rel: str) -> str:
        """The store's URL for the path ``rel`` under the mount."""

    def wait_until_visible(self, path: str, timeout_s: float | None = None) -> None:
        """Poll the mount until Spark's ``_SUCCESS`` file under ``path`` is visible."""
        timeout = self.visibility_timeout_s if timeout_s is None else timeout_s
        _poll(lambda: self.exists(posixpath.join(path, "_SUCCESS")), timeout, f"Spark output {path!r} in {self!r}")
