"""A store on a local (or cluster-shared, NFS-mounted) directory."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

from spark_hvd.store.base import Store
from spark_hvd.store.errors import StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    import fsspec
    import pyarrow.fs


class LocalStore(Store):
    """A store under a local path or ``file://`` URL. Directories are committed by ``os.rename``.

    On a multi-machine cluster the directory must be on a filesystem every executor mounts at the same path.
    """

    supports_rename = True

    def __init__(self, url: str, **storage_options: Any) -> None:
        if storage_options:
            raise StoreURLError(f"a local store takes no storage options, got {sorted(storage_options)} for {url!r}")
        path = url[len("file://") :] if url.startswith("file://") else url
        if url.startswith("file:") and not url.startswith("file://"):
            path = url[len("file:") :]
        self._prefix = os.path.abspath(os.path.expanduser(path)).rstrip("/") or "/"
        super().__init__(self._prefix)

    @property
    def prefix_path(self) -> str:
        return self._prefix

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(auto_mkdir=True)

    def _make_pyarrow_fs(self) -> pyarrow.fs.FileSystem:
        import pyarrow.fs

        return pyarrow.fs.LocalFileSystem()

    def spark_url(self, path: str) -> str:
        """``file://`` + the absolute path."""
        return "file://" + path

    def _rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write through a temporary file and ``os.replace``, so readers never see a partial file."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(bytes(data))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def local_path(self, path: str) -> str:
        """The local filesystem path of a store path (the same string for a local store)."""
        return path
