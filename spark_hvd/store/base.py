"""The :class:`Store` contract: where prepared data, checkpoints, logs and models of a job live.

(Longer than ~400 lines on purpose: this is the one class a store implementer reads, the whole contract every
store honours: layout, bytes and listings, directories, atomic commits, visibility. The commit protocol, the
manifest, the scheme registry, the handling of secrets and a run's directory (``RunDir``) live in their own
modules.)

A store is a root (a *prefix*) on some filesystem. Every store, whatever its URL, lays its files out the same way::

    <prefix>/data/<dataset_key>/train/part-*.parquet   written by spark_hvd.data (Spark or pyarrow)
    <prefix>/data/<dataset_key>/val/part-*.parquet
    <prefix>/data/<dataset_key>/_metadata.json          columns, dtypes, shapes, row counts
    <prefix>/runs/<run_id>/...                          a training run: :class:`~spark_hvd.store.run_dir.RunDir`

Horovod's constructor arguments move two of these (``Store._place``): ``train_path`` the ``data`` directory (both
splits of a dataset stay in its one directory), ``runs_path`` the ``runs`` directory; Horovod's other Store methods
are :class:`~spark_hvd.store.horovod_api.HorovodStoreAPI`'s.

Paths. Every ``*_path`` method returns a *store path*: the filesystem's own absolute path (``/abs/dir/...`` for a
local or DBFS store, ``bucket/prefix/...`` for S3, ``/user/x/...`` for HDFS). The same string is understood by

- the store's own methods (:meth:`Store.exists`, :meth:`Store.read_bytes`, :meth:`Store.write_bytes`, ...);
- the pyarrow filesystem of :meth:`Store.pyarrow_filesystem` (``pyarrow.dataset.dataset(path, filesystem=...)``);
- the fsspec filesystem :attr:`Store.fs`.

:meth:`Store.spark_url` turns a store path into the URL Spark's ``df.write.parquet`` needs (``file:///...``,
``dbfs:/...``, ``hdfs://nn:8020/...``, ``s3a://bucket/...``). Spark writes to S3, GCS or ADLS need the cluster's own
connector setup (for S3: the hadoop-aws jars and ``fs.s3a.*`` credentials); the store does not provide them.

Atomic directories. A directory written with :meth:`Store.atomic_dir` is either complete or absent to readers, and
a crash never removes its last committed version: files are written aside (or in place where nothing is committed
yet and the store cannot rename), fsynced where the filesystem supports it, and committed by a manifest of sizes and
checksums written last (``_MANIFEST.json``); a committed version is replaced only once its successor is committed.
:mod:`spark_hvd.store.atomic` has the protocol and its recovery, :mod:`spark_hvd.store.manifest` the manifest.
:meth:`Store.is_committed` checks for a manifest, :meth:`Store.verify` checks the files against it. A run's
checkpoints (``RunDir.write_checkpoint``; ``RunDir.latest_checkpoint`` gives the newest that verifies) and prepared
datasets are written this way.

Pickling. A store pickles as its URL, storage options and Horovod layout arguments (no open connection), so it
can be shipped to Spark executors and training processes; the filesystem is opened again lazily on first use
there. A ``memory://`` store is per process: its files are not visible to other processes. A store written into a
saved stage goes through :meth:`Store.without_secrets` first: its pickle keeps the URL and non-secret options only
(see :mod:`spark_hvd.store.secrets` for how the secrets come back at load time).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from spark_hvd.store import atomic
from spark_hvd.store.atomic import TMP_PREFIX
from spark_hvd.store.errors import StoreError, StoreTimeoutError, StoreURLError
from spark_hvd.store.horovod_api import HorovodStoreAPI
from spark_hvd.store.manifest import LEGACY_MARKER, MANIFEST, Manifest, sha256_of
from spark_hvd.store.registry import class_name, store_class

if TYPE_CHECKING:  # pragma: no cover
    import fsspec
    import pyarrow.fs

logger = logging.getLogger(__name__)

#: Name of the file that marks an atomically written directory as complete: its manifest.
COMMIT_MARKER = MANIFEST
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


def scheme_of(url: str) -> str:
    """The store scheme of ``url``: ``""`` (local), ``file``, ``dbfs``, ``volumes``, ``hdfs``, or an fsspec one."""
    if url.startswith(("/Volumes/", "dbfs:/Volumes/")):
        return "volumes"
    if url == "/dbfs" or url.startswith(("/dbfs/", "file:/dbfs/", "file:///dbfs/")):
        return "dbfs"
    m = _SCHEME_RE.match(url)
    if not m or len(m.group(1)) == 1:  # no scheme, or a Windows drive letter
        return ""
    return m.group(1).lower()


def _restore_store(cls: type[Store], url: str, storage_options: dict[str, Any],
                   layout: dict[str, str] | None = None) -> Store:
    return cls(url, **storage_options, **(layout or {}))


#: Horovod's Store constructor arguments that place the store's directories (see :meth:`Store._place`); every
#: store's constructor takes them besides its storage options
LAYOUT_ARGS = ("train_path", "val_path", "test_path", "runs_path")


def split_layout(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A constructor's keywords as (storage options, the ``LAYOUT_ARGS`` given)."""
    return ({k: v for k, v in options.items() if k not in LAYOUT_ARGS},
            {k: v for k, v in options.items() if k in LAYOUT_ARGS and v is not None})


class Store(HorovodStoreAPI, ABC):
    """Root of a job's files on a local disk, DBFS, HDFS or any fsspec filesystem (see the module docstring).

    Create one with :meth:`Store.create`; the subclass is chosen by URL scheme from
    :mod:`spark_hvd.store.registry` (where users register their own).

    Attributes:
        url: the canonical URL of the prefix (a relative local path is made absolute).
        storage_options: the options given to :meth:`create` (passed to the filesystem).
        supports_rename: whether :meth:`atomic_dir` commits by renaming a temporary directory (else by marker).
    """

    supports_rename: bool = False

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url
        self.storage_options = dict(storage_options)
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pa_fs: pyarrow.fs.FileSystem | None = None
        self._recorded: dict[str, tuple[int, str]] = {}  # path -> (size, sha256) of files this process wrote
        self._dropped_secrets: list[str] | None = None  # set by without_secrets
        self._layout: dict[str, str] = {}  # the LAYOUT_ARGS given, as given (set by _place)
        self._roots: dict[str, str] = {}  # "data", "runs", "test": the store paths they name

    # ------------------------------------------------------------------ construction
    @staticmethod
    def create(url: str, **storage_options: Any) -> Store:
        """The store for ``url``, chosen by its scheme.

        - a local path or ``file://...``: :class:`~spark_hvd.store.local.LocalStore`;
        - ``dbfs:/...`` or ``/dbfs/...``: :class:`~spark_hvd.store.dbfs.DBFSStore` (Databricks FUSE mount);
        - ``/Volumes/<catalog>/<schema>/<volume>/...``: :class:`~spark_hvd.store.volumes.VolumesStore`;
        - ``hdfs://host:port/path`` (or ``hdfs:///path``): :class:`~spark_hvd.store.hdfs.HDFSStore`;
        - any other fsspec protocol (``s3://``, ``gs://``, ``abfs://``, ``memory://``, ...):
          :class:`~spark_hvd.store.fsspec_store.FsspecStore`, with ``storage_options`` passed to
          ``fsspec.filesystem(protocol, **storage_options)`` untouched;
        - a scheme registered with :func:`~spark_hvd.store.registry.register_store`: that class.
        """
        if not isinstance(url, str) or not url.strip():
            raise StoreURLError(f"Store.create needs a non-empty URL string, got {url!r}")
        scheme = scheme_of(url)
        cls = store_class(scheme)
        if not issubclass(cls, Store):
            raise StoreURLError(f"the store registered for scheme {scheme!r}, {class_name(cls)}, is not a Store "
                                "subclass")
        return cls(url, **storage_options)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._dropped_secrets is not None:
            from spark_hvd.store.secrets import restore_without_secrets

            return (restore_without_secrets, (type(self), self.url, self.storage_options, self._dropped_secrets,
                                              self._layout))
        return (_restore_store, (type(self), self.url, self.storage_options, self._layout))

    def without_secrets(self) -> Store:
        """This store, minus its secret storage options (keys, secrets, tokens, passwords, credential objects),
        for pickles that are saved (an estimator's ``save``). Unpickled, it takes its options from
        ``SPARK_HVD_STORAGE_OPTIONS``; :meth:`with_options` adds them back by hand."""
        from spark_hvd.store.secrets import split_secrets

        public, dropped = split_secrets(self.storage_options)
        clone = type(self)(self.url, **public, **self._layout)
        clone._dropped_secrets = dropped
        return clone

    def with_options(self, **storage_options: Any) -> Store:
        """A store of the same URL with ``storage_options`` added to (or replacing) this one's, e.g. the
        credentials of a store loaded from a saved stage: ``est.setStore(est.getStore().with_options(key=...,
        secret=...))``."""
        from spark_hvd.store.secrets import merge_options

        return type(self)(self.url, **merge_options(self.storage_options, storage_options), **self._layout)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.url == other.url and \
            self.storage_options == other.storage_options and self._layout == other._layout

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.url))

    # ------------------------------------------------------------------ what a subclass provides
    @property
    @abstractmethod
    def prefix_path(self) -> str:
        """The store path of the root (no trailing slash)."""

    @abstractmethod
    def _make_fs(self) -> fsspec.AbstractFileSystem:
        """Open the fsspec filesystem (called lazily, once per process)."""

    @abstractmethod
    def _make_pyarrow_fs(self) -> pyarrow.fs.FileSystem:
        """Open the pyarrow filesystem (called lazily, once per process)."""

    @abstractmethod
    def spark_url(self, path: str) -> str:
        """The URL under which Spark reads and writes the store path ``path``.

        Raises:
            StoreError: when Spark cannot reach this store at all (``memory://``).
        """

    def _rename(self, src: str, dst: str) -> None:
        """Rename a directory (only called where :attr:`supports_rename`)."""
        self.fs.mv(src, dst, recursive=True)

    # ------------------------------------------------------------------ filesystems
    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem of this store (opened on first use in each process)."""
        if self._fs is None:
            self._fs = self._make_fs()
        return self._fs

    def pyarrow_filesystem(self) -> pyarrow.fs.FileSystem:
        """A pyarrow filesystem that understands store paths, for ``pyarrow.dataset`` and ``pyarrow.parquet``."""
        if self._pa_fs is None:
            self._pa_fs = self._make_pyarrow_fs()
        return self._pa_fs

    def check_writable(self) -> None:
        """Write and delete a small probe file under the prefix, so an unwritable store fails on the driver before
        any task starts rather than in a training process after the data was prepared.

        Raises:
            StoreError: naming the URL and what the filesystem said.
        """
        probe = self.path(f"{TMP_PREFIX}probe-{uuid.uuid4().hex[:12]}")
        try:
            self.write_bytes(probe, b"spark_hvd write probe")
            self.delete(probe)
        except Exception as e:  # noqa: BLE001 - any failure means the same to the user
            raise StoreError(f"the store {self.url!r} is not writable ({type(e).__name__}: {e}); spark_hvd writes "
                             "prepared data, checkpoints and the model there: check the path, its permissions "
                             "or the credentials in the storage options") from e
        finally:
            self._recorded.pop(posixpath.normpath(probe), None)

    # ------------------------------------------------------------------ layout
    def path(self, *parts: str) -> str:
        """The store path of ``parts`` joined under the prefix."""
        return posixpath.join(self.prefix_path, *parts) if parts else self.prefix_path

    def data_root(self) -> str:
        """``<prefix>/data`` (or the constructor's ``train_path``): where prepared datasets live."""
        return self._roots.get("data") or self.path("data")

    def data_path(self, key: str) -> str:
        """``<prefix>/data/<key>``: the directory of one prepared dataset."""
        return self._entry(self.data_root(), key, "dataset key")

    def train_data_path(self, key: str) -> str:
        """``<prefix>/data/<key>/train``: the training Parquet files of a dataset."""
        return posixpath.join(self.data_path(key), "train")

    def val_data_path(self, key: str) -> str:
        """``<prefix>/data/<key>/val``: the validation Parquet files of a dataset."""
        return posixpath.join(self.data_path(key), "val")

    def metadata_path(self, key: str) -> str:
        """``<prefix>/data/<key>/_metadata.json``: columns, dtypes, shapes and row counts of a dataset."""
        return posixpath.join(self.data_path(key), "_metadata.json")

    def runs_root(self) -> str:
        """``<prefix>/runs`` (or the constructor's ``runs_path``)."""
        return self._roots.get("runs") or self.path("runs")

    def run_path(self, run_id: str) -> str:
        """``<prefix>/runs/<run_id>``: everything of one training run."""
        return self._entry(self.runs_root(), run_id, "run_id")

    def _entry(self, root: str, name: str, what: str) -> str:
        _check_name(name, what)
        return posixpath.join(root, name)

    def _place(self, train_path: str | None = None, val_path: str | None = None, test_path: str | None = None,
               runs_path: str | None = None) -> None:
        """Horovod's constructor arguments that move the store's directories (each a path relative to the prefix,
        an absolute path in the store's filesystem, or a URL under the store's root). ``train_path``: where the
        prepared datasets go (``data_root``); both splits of one dataset live in its one directory, committed
        together, so ``val_path`` may only repeat ``train_path``. ``runs_path``: where the runs go
        (``runs_root``). ``test_path``: what ``get_test_data_path`` returns (Horovod's estimators never write test
        data either). Raises ``StoreURLError`` naming the argument."""
        given = {k: v for k, v in (("train_path", train_path), ("val_path", val_path), ("test_path", test_path),
                                   ("runs_path", runs_path)) if v is not None}
        roots = {name: self._layout_path(name, value) for name, value in given.items()}
        if "val_path" in roots and roots["val_path"] != roots.get("train_path"):
            raise StoreURLError(f"val_path={val_path!r}: a prepared dataset keeps its training and validation "
                                "splits in one directory, committed together; give train_path (the datasets' "
                                "directory, both splits) and leave val_path out or equal to it")
        self._layout = given
        self._roots = {"data": roots.get("train_path", ""), "runs": roots.get("runs_path", ""),
                       "test": roots.get("test_path", "")}

    def _layout_path(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise StoreURLError(f"{name} must be a non-empty path string, got {value!r}")
        if scheme_of(value):
            try:
                return self.get_localized_path(value)
            except StoreURLError as e:
                raise StoreURLError(f"{name}={value!r}: {e}; give a path relative to the store's prefix or an "
                                    "absolute path in its filesystem") from e
        path = value if value.startswith("/") else self.path(value)
        return posixpath.normpath(path).rstrip("/") or "/"

    # ------------------------------------------------------------------ Horovod's Store names
    def get_full_path(self, path: str) -> str:
        """Horovod's name of :meth:`spark_url`: the URL Spark and other tools use for the store path ``path``."""
        return self.spark_url(path)

    def get_localized_path(self, url: str) -> str:
        """The store path of a URL :meth:`get_full_path` gave (the inverse; Horovod's name). A store path is
        returned as it is; a URL of another store or filesystem is a ``StoreURLError``."""
        if scheme_of(url) in ("", "dbfs") and url.startswith("/"):
            return url
        root = self.spark_url(self.prefix_path)
        base = root.rstrip("/")
        if url != root and url != base and not url.startswith(base + "/"):
            raise StoreURLError(f"{url!r} is not a URL of the store {self.url!r} (its URLs start with {root!r})")
        rest = url[len(base):].lstrip("/")
        return posixpath.join(self.prefix_path, rest) if rest else self.prefix_path

    def get_run_path(self, run_id: str) -> str:
        """Horovod's name of :meth:`run_path`."""
        return self.run_path(run_id)

    # ------------------------------------------------------------------ bytes and listings
    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at the store path ``path``."""
        self._invalidate(path)
        return bool(self.fs.exists(path))

    def read_bytes(self, path: str) -> bytes:
        """The content of the file at ``path``.

        Raises:
            FileNotFoundError: naming the path and the store.
        """
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no file {path!r} in {self!r}") from e

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to the file ``path`` (parents created). Readers never see a partial file."""
        data = bytes(data)
        self._makedirs(posixpath.dirname(path))
        self.fs.pipe_file(path, data)
        self._record(path, data)
        self._invalidate(path)

    def read_json(self, path: str) -> Any:
        """The JSON document in the file ``path``."""
        return json.loads(self.read_bytes(path).decode("utf-8"))

    def write_json(self, path: str, obj: Any) -> None:
        """Write ``obj`` as indented JSON to ``path``."""
        self.write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode("utf-8"))

    def delete(self, path: str) -> None:
        """Delete the file or directory tree at ``path``; nothing happens when it does not exist."""
        if self.exists(path):
            self.fs.rm(path, recursive=True)
            self._invalidate(path)

    def listdir(self, path: str) -> list[str]:
        """Sorted names (not paths) of the entries in directory ``path``; temporary entries are left out.

        A missing directory lists as ``[]``.
        """
        return [name for name in self._raw_names(path) if not name.startswith(TMP_PREFIX)]

    def list_runs(self) -> list[str]:
        """The run ids under ``<prefix>/runs``, sorted."""
        return self.listdir(self.runs_root())

    def list_datasets(self) -> list[str]:
        """The keys of the committed datasets under ``<prefix>/data``, sorted."""
        return [k for k in self.listdir(self.data_root()) if self.is_committed(self.data_path(k))]

    def clean(self, unused_for_days: float = 7.0, keep: Iterable[str] = (), dry_run: bool = False) -> list[str]:
        """Delete prepared datasets that no fit used for ``unused_for_days`` days (:mod:`spark_hvd.store.hygiene`)."""
        from spark_hvd.store.hygiene import clean

        return clean(self, unused_for_days, keep, dry_run)

    # ------------------------------------------------------------------ directories
    def upload_dir(self, local_dir: str, path: str) -> None:
        """Copy every file under the local directory ``local_dir`` to the store directory ``path``."""
        for local, rel in _walk_files(local_dir):
            remote = posixpath.join(path, rel)
            self._makedirs(posixpath.dirname(remote))
            self._recorded[posixpath.normpath(remote)] = self._put_file(local, remote)
        self._invalidate(path)

    def _put_file(self, local: str, remote: str) -> tuple[int, str]:
        """Copy the local file ``local`` to the store path ``remote``; its size and hex SHA-256 (for the manifest)."""
        self.fs.put_file(local, remote)
        with open(local, "rb") as f:
            return os.fstat(f.fileno()).st_size, sha256_of(f)

    def download_dir(self, path: str, local_dir: str) -> str:
        """Copy every file under the store directory ``path`` into ``local_dir``; returns ``local_dir``."""
        if not self.exists(path):
            raise FileNotFoundError(f"no directory {path!r} in {self!r}")
        base = path.rstrip("/")
        os.makedirs(local_dir, exist_ok=True)
        for remote in self.fs.find(base):
            remote = str(remote)
            rel = remote[len(base) :].lstrip("/") if remote.startswith(base) else posixpath.basename(remote)
            if not rel or rel in (MANIFEST, LEGACY_MARKER):
                continue
            target = os.path.join(local_dir, *rel.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.get_file(remote, target)
        return local_dir

    def atomic_dir(self, path: str, overwrite: bool = True) -> contextlib.AbstractContextManager[str]:
        """Write a directory that readers see complete or not at all, and that a crash never loses.

        ``with store.atomic_dir(path) as target:`` yields the store path to write into (a hidden sibling, or
        ``path`` itself where nothing is committed there yet and the store cannot rename). On leaving the block
        normally the files are fsynced, the manifest is written last, and the new directory replaces ``path``
        without a moment in which neither version is committed (see :mod:`spark_hvd.store.atomic`). On an exception
        everything written is deleted and the exception propagates.

        Args:
            path: the final store path of the directory.
            overwrite: replace a committed directory already at ``path`` (else raise :class:`StoreError`).
        """
        return atomic.atomic_dir(self, path, overwrite)

    def is_committed(self, path: str) -> bool:
        """Whether ``path`` holds a manifest, i.e. was committed by :meth:`atomic_dir` (:meth:`verify` checks it)."""
        try:
            Manifest.loads(self.read_bytes(posixpath.join(path.rstrip("/"), MANIFEST)))
        except (FileNotFoundError, ValueError):
            return False
        return True

    def verify(self, path: str) -> str | None:
        """What is wrong with the directory ``path`` (no manifest, a missing, truncated or altered file), or ``None``
        when every file matches the manifest. Reads every checksummed file."""
        return atomic.verify(self, path.rstrip("/"))

    # ------------------------------------------------------------------ visibility
    def wait_until_visible(self, path: str, timeout_s: float | None = None) -> None:
        """Wait until what Spark wrote under ``path`` is visible through this store.

        Local, HDFS and object stores are consistent after the write returns: this only checks that ``path``
        exists. The DBFS store polls its FUSE mount for Spark's ``_SUCCESS`` file.

        Raises:
            StoreTimeoutError: ``path`` did not appear within ``timeout_s``.
        """
        _poll(lambda: self.exists(path), timeout_s or 0.0, f"{path!r} in {self!r}")

    # ------------------------------------------------------------------ helpers
    def _makedirs(self, path: str) -> None:
        if path:
            self.fs.makedirs(path, exist_ok=True)

    def _fsync_tree(self, path: str, files: bool = True, recursive: bool = True) -> None:
        """Make what is under ``path`` durable (files if ``files``, and directories). Only a store on a local or
        mounted filesystem has anything to do: an object store's write is durable when it returns."""
        return None

    def _record(self, path: str, data: bytes) -> None:
        """Remember the size and SHA-256 of a file this process wrote, for the manifest of its directory."""
        self._recorded[posixpath.normpath(path)] = (len(data), hashlib.sha256(data).hexdigest())

    def _take_recorded(self, directory: str) -> dict[str, tuple[int, str]]:
        """Forget and return what :meth:`_record` kept for files under ``directory`` (keyed by relative path)."""
        base = posixpath.normpath(directory) + "/"
        taken = {key: self._recorded.pop(key) for key in [k for k in self._recorded if k.startswith(base)]}
        return {key[len(base) :]: value for key, value in taken.items()}

    def _raw_names(self, path: str) -> list[str]:
        """Names of every entry of directory ``path``, hidden ones included (``[]`` when it is missing)."""
        self._invalidate(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).rstrip("/") != base}
        return sorted(n for n in names if n)

    def _file_sizes(self, path: str) -> dict[str, int]:
        """Relative posix path -> size of every file under directory ``path``."""
        self._invalidate(path)
        base = str(self.fs._strip_protocol(path)).rstrip("/")
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for name, info in found.items():
            name = str(name)
            if info.get("type", "file") == "file" and name.startswith(base + "/"):
                sizes[name[len(base) + 1 :]] = int(info["size"])
        return sizes

    def _sha256(self, path: str) -> str:
        """Hex SHA-256 of the file ``path`` (streamed)."""
        with self.fs.open(path, "rb") as f:
            return sha256_of(f)

    def _invalidate(self, path: str) -> None:
        fs = self._fs
        if fs is not None:
            try:
                fs.invalidate_cache(path)
            except Exception:  # pragma: no cover - a filesystem without a listing cache
                pass


def _poll(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        if check():
            return
        if time.monotonic() >= deadline:
            raise StoreTimeoutError(f"{what} was not visible after {timeout_s:.0f} s")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 2.0)


def _walk_files(local_dir: str) -> Iterator[tuple[str, str]]:
    """(absolute local path, posix path relative to ``local_dir``) of every file under ``local_dir``, sorted."""
    if not os.path.isdir(local_dir):
        raise FileNotFoundError(f"local directory {local_dir!r} does not exist")
    for root, dirs, files in os.walk(local_dir):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(root, f)
            yield full, os.path.relpath(full, local_dir).replace(os.sep, "/")


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or name.startswith(TMP_PREFIX):
        raise ValueError(f"{what} must be a non-empty name without '/', got {name!r}")
