"""The worker processes of ``reader_pool_type="process"``: ``transformation_fn`` runs there on each batch of stored
rows, and the transformed batch comes back through shared memory.

A decoded batch is big (64 images at 224 x 224 as float32: 37 MiB). Pickled back through the pool's pipe, it cost
the rank about as much CPU as decoding it had cost the worker (benchmarks/RESULTS.md, issue 25). So a worker writes
the batch's numeric arrays into one file of a private directory under ``/dev/shm`` (made by the rank, mode 0700,
removed when the pool is shut down) and returns where they lie; the rank maps the file and hands on arrays that are
views of the mapping: no copy. When the last of the batch's arrays goes, the file goes back to the pool, for a
worker to write a later batch into: its pages are allocated already (a few files are kept, others unlinked; a new
file's pages cost the worker their allocation and zeroing, and the rank their freeing). Where there is no writable
``/dev/shm``, where it has no room for a batch (``posix_fallocate`` fails, e.g. a container's default 64 MiB:
checked whenever a file grows, so nothing dies of SIGBUS), or for a small batch (under ``SHARED_MIN_BYTES``), the
batch is pickled back instead.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from spark_hvd.data.columns import frame_to_batch, rows_to_frame
from spark_hvd.data.errors import ReaderError

__all__ = ["SHARED_MIN_BYTES", "SharedBatch", "TransformPool"]

Batch = dict[str, Any]
#: batches whose numeric arrays hold fewer bytes than this are pickled back (a file costs a few system calls)
SHARED_MIN_BYTES = 256 << 10
_ALIGN = 64
_SHM = "/dev/shm"

_WORKER_FN: Any = None
_SHARED_DIR: str | None = None
_SERIAL = itertools.count()


class SharedBatch:
    """Where a worker left a batch: ``path`` (``size`` bytes), each numeric column's ``(offset, dtype, shape)``, and
    the other columns (object arrays, sparse matrices) as they are; ``columns`` keeps the batch's column order."""

    __slots__ = ("columns", "layout", "path", "rest", "size")

    def __init__(self, path: str, size: int, layout: dict[str, tuple[int, str, tuple[int, ...]]],
                 rest: Batch, columns: list[str]) -> None:
        self.path, self.size, self.layout, self.rest, self.columns = path, size, layout, rest, columns

    def __reduce__(self) -> tuple:
        return SharedBatch, (self.path, self.size, self.layout, self.rest, self.columns)


def init_worker(fn_bytes: bytes, shared_dir: str | None) -> None:
    global _WORKER_FN, _SHARED_DIR
    import cloudpickle

    _WORKER_FN, _SHARED_DIR = cloudpickle.loads(fn_bytes), shared_dir


def transform_in_worker(rows: Any, where: str, reuse: str | None = None) -> Batch | SharedBatch:
    """In a worker process: ``transformation_fn`` on a batch of stored rows (see ``columns.rows_to_frame``), stacked
    into a batch there, placed in shared memory where it can be (in the file ``reuse`` if the rank gave one)."""
    batch = frame_to_batch(_WORKER_FN(rows_to_frame(rows)), where)
    return to_shared(batch, _SHARED_DIR, reuse) if _SHARED_DIR is not None else batch


def to_shared(batch: Batch, directory: str, reuse: str | None = None) -> Batch | SharedBatch:
    """``batch``'s numeric arrays copied into one file of ``directory``: ``reuse`` (a file of an earlier batch that
    no array uses any more, grown if need be) or a new one; ``batch`` itself where it is small or the file system
    has no room for it."""
    layout: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    size = 0
    for name, value in batch.items():
        if isinstance(value, np.ndarray) and not value.dtype.hasobject and value.nbytes:
            layout[name] = (size, value.dtype.str, value.shape)
            size += -(-value.nbytes // _ALIGN) * _ALIGN
    if size < SHARED_MIN_BYTES:
        if reuse is not None:
            _unlink(reuse)
        return batch
    path, fd = None, -1
    if reuse is not None:
        try:
            fd, path = os.open(reuse, os.O_RDWR), reuse
        except OSError:  # gone with its pool: a new file
            pass
    if path is None:
        path = os.path.join(directory, f"{os.getpid()}-{next(_SERIAL)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)  # tmpfs reserves the pages now, or says ENOSPC (never SIGBUS later)
        except OSError:
            os.unlink(path)
            return batch
        with mmap.mmap(fd, size) as mapped:
            for name, (offset, dtype, shape) in layout.items():
                target = np.frombuffer(mapped, dtype=dtype, count=int(np.prod(shape)), offset=offset)
                np.copyto(target.reshape(shape), batch[name])
                del target  # the mapping closes only once no array refers to it
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    rest = {name: value for name, value in batch.items() if name not in layout}
    return SharedBatch(path, size, layout, rest, list(batch))


def from_shared(item: Batch | SharedBatch, where: str, recycle: Callable[[str], None] | None = None) -> Batch:
    """In the rank: the batch a worker returned, its numeric arrays views of the shared file (mapped, then
    unlinked: the pages are freed with the last array; or, with ``recycle``, kept and handed to ``recycle`` once
    the last array is gone, for a worker to write a later batch into)."""
    if not isinstance(item, SharedBatch):
        return item
    try:
        fd = os.open(item.path, os.O_RDWR)
    except OSError as exc:
        raise ReaderError(f"{where}: the batch a worker process left in {item.path} is gone: {exc}") from exc
    try:
        mapped = mmap.mmap(fd, item.size)
    except BaseException:
        os.unlink(item.path)
        raise
    finally:
        os.close(fd)
    if recycle is None:
        os.unlink(item.path)
    else:
        weakref.finalize(mapped, recycle, item.path)  # runs when the last array of the batch goes
    batch: Batch = {}
    for name in item.columns:
        if name in item.layout:
            offset, dtype, shape = item.layout[name]
            batch[name] = np.frombuffer(mapped, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        else:
            batch[name] = item.rest[name]
    return batch


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def discard(item: Any) -> None:
    """Remove the file of a batch that will not be read (an epoch stopped early)."""
    if isinstance(item, SharedBatch):
        try:
            os.unlink(item.path)
        except OSError:
            pass


class TransformPool:
    """``workers`` processes holding ``fn`` (forkserver: no fork of a process with threads), each batch's result
    handed back through shared memory where it can be (see the module doc).

    Files are reused: once the last array of a batch is gone (:func:`from_shared` with :meth:`recycle`) its file
    waits, up to ``workers + 2`` of them, for a worker to write a later batch into. At 224 x 224 (64 images, 37 MiB
    a batch) that took the workers' CPU per epoch from 860-870 to 770-800 ms and the rank's from 65-74 to 29-30 ms
    (benchmarks/RESULTS.md, issue 25 session 5). The price: up to that many batches of ``/dev/shm`` held until
    :meth:`shutdown`."""

    def __init__(self, fn: Callable, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        import cloudpickle

        self.shared_dir = _private_shm_dir()
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"),
                                            initializer=init_worker, initargs=(cloudpickle.dumps(fn), self.shared_dir))
        self.keep = workers + 2
        self._free: collections.deque[str] = collections.deque()  # append / popleft: no lock (see recycle)
        self._closed = False

    def submit(self, rows: Any, where: str) -> Future:
        try:
            reuse = self._free.popleft()
        except IndexError:
            reuse = None
        return self.executor.submit(transform_in_worker, rows, where, reuse)

    def recycle(self, path: str) -> None:
        """A batch's file that no array uses any more: kept for a later batch, or removed. (Called by a finalizer,
        so at any point of any thread: no lock, which that same thread might hold.)"""
        if self._closed or len(self._free) >= self.keep:
            _unlink(path)
        else:
            self._free.append(path)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._closed = True
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)
        self._free.clear()
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)


def _private_shm_dir() -> str | None:
    if not (os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK)):
        return None
    try:
        return tempfile.mkdtemp(prefix="spark_hvd-batches-", dir=_SHM)
    except OSError:
        return None
