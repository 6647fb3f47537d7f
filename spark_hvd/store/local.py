"""A store on a local (or cluster-shared, NFS-mounted) directory."""

from __future__ import annotations

import errno
import os
import uuid
from typing import TYPE_CHECKING, Any

from spark_hvd.store.base import Store, split_layout
from spark_hvd.store.errors import StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    import fsspec
    import pyarrow.fs


def _fsync(fd: int) -> None:
    """``os.fsync``, ignoring filesystems that do not support it on this kind of file (some FUSE mounts)."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EROFS):
            raise


class LocalStore(Store):
    """A store under a local path or ``file://`` URL. Directories are committed by ``os.rename``; files and
    directories are fsynced before a commit (where the filesystem supports it).

    On a multi-machine cluster the directory must be on a filesystem every executor mounts at the same path.
    """

    supports_rename = True

    def __init__(self, url: str, **storage_options: Any) -> None:
        storage_options, layout = split_layout(storage_options)
        if storage_options:
            raise StoreURLError(f"a local store takes no storage options, got {sorted(storage_options)} for {url!r}")
        path = url[len("file://") :] if url.startswith("file://") else url
        if url.startswith("file:") and not url.startswith("file://"):
            path = url[len("file:") :]
        self._prefix = os.path.abspath(os.path.expanduser(path)).rstrip("/") or "/"
        super().__init__(self._prefix)
        self._place(**layout)

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
        """Write through a temporary file, fsync and ``os.replace``, so readers never see a partial file."""
        data = bytes(data)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                _fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        self._fsync_tree(os.path.dirname(path) or ".", files=False, recursive=False)
        self._record(path, data)

    def _fsync_tree(self, path: str, files: bool = True, recursive: bool = True) -> None:
        """fsync the directories (and with ``files`` the files) under ``path``, where the filesystem supports it."""
        if not os.path.isdir(path):
            return
        walk = os.walk(path) if recursive else [(path, [], [])]
        for root, _, names in walk:
            if files:
                for name in names:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    try:
                        _fsync(fd)
                    finally:
                        os.close(fd)
            fd = os.open(root, os.O_RDONLY)
            try:
                _fsync(fd)
            finally:
                os.close(fd)

    def local_path(self, path: str) -> str:
        """The local filesystem path of a store path (the same string for a local store)."""
        return path
