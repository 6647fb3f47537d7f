"""A store on HDFS through pyarrow's ``HadoopFileSystem`` (libhdfs; needs a Hadoop client on the machine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from spark_hvd.store.base import Store, split_layout
from spark_hvd.store.errors import StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    import fsspec
    import pyarrow.fs

#: Storage options passed on to ``pyarrow.fs.HadoopFileSystem``.
HDFS_OPTIONS = ("user", "kerb_ticket", "extra_conf", "replication", "buffer_size", "default_block_size")
DEFAULT_PORT = 8020


class HDFSStore(Store):
    """A store under ``hdfs://namenode:port/path`` or ``hdfs:///path`` (the cluster's ``fs.defaultFS``); an absolute
    path without a scheme given to ``HDFSStore`` itself is ``hdfs:///path``, as in Horovod (``Store.create`` takes such
    a path as a local one).

    Storage options (all optional): ``user``, ``kerb_ticket``, ``extra_conf`` (dict of Hadoop settings),
    ``replication``, ``buffer_size``, ``default_block_size``; they go to ``pyarrow.fs.HadoopFileSystem``, which needs
    ``HADOOP_HOME``/``CLASSPATH`` set as on any Hadoop client. Directories are committed by an HDFS rename (atomic).
    """

    supports_rename = True

    def __init__(self, url: str, **storage_options: Any) -> None:
        storage_options, layout = split_layout(storage_options)
        unknown = sorted(set(storage_options) - set(HDFS_OPTIONS))
        if unknown:
            raise StoreURLError(f"unknown HDFS storage options {unknown} for {url!r}; known: {list(HDFS_OPTIONS)}")
        if url.startswith("/"):
            url = "hdfs://" + url
        parsed = urlparse(url)
        if parsed.scheme not in ("hdfs", "viewfs"):
            raise StoreURLError(f"not an HDFS URL: {url!r}")
        try:
            port = parsed.port
        except ValueError as e:
            raise StoreURLError(f"bad port in HDFS URL {url!r}") from e
        self.scheme = parsed.scheme
        self.host = parsed.hostname or "default"
        self.port = port if port is not None else (DEFAULT_PORT if parsed.hostname else 0)
        path = parsed.path.rstrip("/") or "/"
        if not path.startswith("/"):
            path = "/" + path
        self._prefix = path
        if parsed.hostname:
            netloc = f"{parsed.hostname}:{self.port}"
            canonical = f"{parsed.scheme}://{netloc}{path}"
        else:
            canonical = f"{parsed.scheme}://{path}"
        super().__init__(canonical, **storage_options)
        self._place(**layout)

    @property
    def prefix_path(self) -> str:
        return self._prefix

    def pyarrow_kwargs(self) -> dict[str, Any]:
        """The keyword arguments given to ``pyarrow.fs.HadoopFileSystem``."""
        kwargs: dict[str, Any] = {"host": self.host, "port": self.port}
        kwargs.update(self.storage_options)
        if "extra_conf" in kwargs and kwargs["extra_conf"] is not None:
            kwargs["extra_conf"] = {str(k): str(v) for k, v in dict(kwargs["extra_conf"]).items()}
        return kwargs

    def _make_pyarrow_fs(self) -> pyarrow.fs.FileSystem:
        import pyarrow.fs

        return pyarrow.fs.HadoopFileSystem(**self.pyarrow_kwargs())

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        from fsspec.implementations.arrow import ArrowFSWrapper

        return ArrowFSWrapper(self.pyarrow_filesystem())

    def spark_url(self, path: str) -> str:
        """``hdfs://host:port/path``, or ``hdfs:///path`` for the default namenode."""
        if self.host == "default":
            return f"{self.scheme}://{path}"
        return f"{self.scheme}://{self.host}:{self.port}{path}"

    def get_localized_path(self, url: str) -> str:
        """The path of an URL on this store's namenode (``hdfs://nn:8020/a/b`` -> ``/a/b``; Horovod's name); a path
        is returned as it is. An URL of another namenode or scheme is a ``StoreURLError``."""
        if url.startswith("/"):
            return url
        parsed = urlparse(url)
        same = parsed.scheme == self.scheme and (parsed.hostname or "default") == self.host and (
            parsed.hostname is None or (parsed.port or DEFAULT_PORT) == self.port)
        if not same:
            raise StoreURLError(f"{url!r} is not on the namenode of the store {self.url!r}")
        return parsed.path or "/"

    def _rename(self, src: str, dst: str) -> None:
        self.pyarrow_filesystem().move(src, dst)
