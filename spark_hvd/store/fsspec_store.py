"""A store on any fsspec filesystem: ``s3://``, ``gs://``, ``abfs://``, ``memory://``, ..."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from spark_hvd.store.base import Store, split_layout
from spark_hvd.store.errors import StoreError, StoreURLError
from spark_hvd.store.manifest import sha256_of

if TYPE_CHECKING:  # pragma: no cover
    import fsspec
    import pyarrow.fs


class FsspecStore(Store):
    """A store on the fsspec filesystem of the URL's protocol, opened as ``fsspec.filesystem(protocol, **options)``.

    ``storage_options`` are passed through untouched (for ``s3://``: ``key``, ``secret``, ``endpoint_url``,
    ``client_kwargs`` ...). Object stores have no atomic directory rename, so directories are committed with the
    ``_COMMITTED`` marker. pyarrow reads through ``pyarrow.fs.PyFileSystem(FSSpecHandler(fs))``.

    Spark URLs: ``s3://b/p`` becomes ``s3a://b/p`` (the cluster needs hadoop-aws and its ``fs.s3a.*``
    credentials), ``gs://`` stays, ``abfs://container/p`` becomes
    ``abfss://container@<account_name>.dfs.core.windows.net/p``; a ``memory://`` store cannot be reached by Spark.
    """

    supports_rename = False

    #: An S3 file up to this size is uploaded in one PutObject whose body streams from the open file (S3 takes up to
    #: 5 GiB in one PUT); a larger one goes through s3fs's ``put_file`` (multipart, parts read into memory).
    s3_single_put_max = 1 << 30

    def __init__(self, url: str, **storage_options: Any) -> None:
        storage_options, layout = split_layout(storage_options)
        if "://" not in url:
            raise StoreURLError(f"not a URL with a protocol: {url!r}")
        protocol = url.split("://", 1)[0].lower()
        import fsspec

        try:
            cls = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as e:
            raise StoreURLError(f"no filesystem for {protocol}:// ({url!r}): {e}") from e
        self.protocol = protocol
        prefix = str(cls._strip_protocol(url)).rstrip("/")
        if not prefix:
            raise StoreURLError(f"{url!r} names no bucket or directory to use as the store's prefix")
        self._prefix = prefix
        super().__init__(url.rstrip("/"), **storage_options)
        self._place(**layout)

    @property
    def prefix_path(self) -> str:
        return self._prefix

    def _make_fs(self) -> fsspec.AbstractFileSystem:
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)

    def _make_pyarrow_fs(self) -> pyarrow.fs.FileSystem:
        import pyarrow.fs

        return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(self.fs))

    def _put_file(self, local: str, remote: str) -> tuple[int, str]:
        """On S3, a file up to ``s3_single_put_max`` is hashed, then sent as one PutObject streamed from the file:
        s3fs's ``put_file`` reads such a file into one bytes object first (as much memory as the file), and the
        manifest's hash read it again: a 100 MB file cost the uploading process 0.29-0.32 s of CPU that way, 0.22 s
        streamed (moto over HTTP and HTTPS; benchmarks/RESULTS.md, issue 29)."""
        if self.protocol not in ("s3", "s3a"):
            return super()._put_file(local, remote)
        with open(local, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > self.s3_single_put_max:
                return super()._put_file(local, remote)
            digest = sha256_of(f)
            f.seek(0)
            bucket, key, _ = self.fs.split_path(remote)
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=f)
        self.fs.invalidate_cache(remote)
        return size, digest

    def spark_url(self, path: str) -> str:
        p = path.lstrip("/")
        if self.protocol in ("s3", "s3a", "s3n"):
            return f"s3a://{p}"
        if self.protocol in ("gs", "gcs"):
            return f"gs://{p}"
        if self.protocol in ("abfs", "abfss", "az"):
            account = self.storage_options.get("account_name")
            if not account:
                raise StoreError(
                    f"Spark needs the storage account of {self.url!r}: create the store with account_name=..."
                )
            container, _, rest = p.partition("/")
            return f"abfss://{container}@{account}.dfs.core.windows.net/{rest}"
        if self.protocol == "memory":
            raise StoreError(
                f"{self.url!r} is an in-process memory store: Spark executors cannot reach it; "
                "use a local path, dbfs:/, hdfs:// or an object store URL"
            )
        return f"{self.protocol}://{p}"
