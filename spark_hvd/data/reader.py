"""Worker side: a sharded, shuffling batch reader over ``pyarrow.dataset``.

Rank ``r`` of ``n`` reads its own row groups (*pieces*) of the Parquet files, assigned so that the ranks' row counts
are as even as they can be; every rank yields the same number of batches per epoch. Each epoch the order of the
rank's pieces is shuffled and rows are mixed in a bounded buffer, differently each epoch and reproducibly from the
seed. Batches are dicts of numpy arrays, ``(batch, *shape)`` per column; a list column becomes one reshape of its
flat values (zero-copy where Arrow allows), never a Python loop per row. Batches are read ahead on a thread.

Epoch semantics. Let ``R_r`` be the rows of rank r's shard and ``R = max_r R_r``. Every rank yields ``R`` rows per
epoch in ``steps_per_epoch = ceil(R / batch_size)`` batches (the last one possibly smaller, the same size on every
rank): first its whole shard once, then, where ``R_r < R``, ``R - R_r`` rows of its shard again (fewer than one row
group). So every row is read at least once per epoch and no rank waits for another at the end of an epoch. With
``drop_last=True`` every batch is full and each rank yields ``floor(min_r R_r / batch_size)`` batches.

Memory pool. pyarrow 26's default allocator (mimalloc) decoded list columns markedly slower than jemalloc on our
machines (see DESIGN.md and benchmarks/reader.py); the reader uses ``pa.jemalloc_memory_pool()`` where pyarrow
has it, unless ``memory_pool`` says otherwise.

Over 400 lines on purpose: shard assignment, the epoch semantics above, shuffling and the read-ahead thread are one
contract that every rank must apply identically.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_hvd.data.batching import (
    ROWS,
    ArrowRows,
    Block,
    compact,
    nbytes,
    num_rows,
    sequential_batches,
    shuffled_batches,
)
from spark_hvd.data.columns import (
    arrow_kind,
    frame_to_batch,
    is_list,
    pad_ragged,
    plain_type,
    rows_to_frame,
    sparse_to_csr,
)
from spark_hvd.data.errors import InvalidParamError, ReaderError, ReaderTimeoutError, TooFewRowsError
from spark_hvd.data.process_pool import TransformPool, discard, from_shared

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    import pyarrow as pa
    import pyarrow.fs

    from spark_hvd.data.metadata import DatasetInfo
    from spark_hvd.store import Store

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]
#: The most bytes of rows the shuffle buffer mixes unless ``shuffle_buffer_rows`` says otherwise.
DEFAULT_SHUFFLE_BYTES = 256 << 20
#: About the most bytes of batches gathered at once from the shuffle buffer (``batching.shuffled_batches``).
SLAB_BYTES = 1 << 20


@dataclass(frozen=True)
class Piece:
    """A unit of sharding: rows ``[start, start + num_rows)`` of row group ``row_group`` of file ``file_index``."""

    file_index: int
    row_group: int
    start: int
    num_rows: int
    whole: bool  # the piece is the entire row group


def resolve_memory_pool(memory_pool: str | pa.MemoryPool | None) -> pa.MemoryPool:
    """``"jemalloc"`` (falls back to the default where pyarrow lacks it), ``"mimalloc"``, ``"system"``,
    ``"default"``/``None``, or a ``pa.MemoryPool``."""
    import pyarrow as pa

    if memory_pool is None or memory_pool == "default":
        return pa.default_memory_pool()
    if isinstance(memory_pool, pa.MemoryPool):
        return memory_pool
    makers = {"jemalloc": pa.jemalloc_memory_pool, "mimalloc": pa.mimalloc_memory_pool, "system": pa.system_memory_pool}
    if memory_pool not in makers:
        raise InvalidParamError(f"memory_pool must be one of {sorted(makers)}, 'default' or a pa.MemoryPool")
    try:
        return makers[memory_pool]()
    except NotImplementedError:
        logger.info("pyarrow has no %s allocator; using the default pool", memory_pool)
        return pa.default_memory_pool()


def assign_pieces(pieces: Sequence[Piece], size: int) -> list[list[Piece]]:
    """Split ``pieces`` over ``size`` ranks, balancing rows (largest first to the rank with fewest rows).

    Deterministic: every rank computes the same assignment from the same file listing.
    """
    order = sorted(pieces, key=lambda p: (-p.num_rows, p.file_index, p.row_group, p.start))
    heap = [(0, r) for r in range(size)]
    shards: list[list[Piece]] = [[] for _ in range(size)]
    for p in order:
        rows, r = heapq.heappop(heap)
        shards[r].append(p)
        heapq.heappush(heap, (rows + p.num_rows, r))
    for s in shards:
        s.sort(key=lambda p: (p.file_index, p.row_group, p.start))
    return shards


class BatchReader:
    """Batches of one rank's shard of a Parquet dataset.

    Args:
        path: store path (or any path of ``filesystem``) of a directory of Parquet files.
        filesystem: a pyarrow filesystem (``store.pyarrow_filesystem()``); ``None`` for local paths.
        columns: the columns to read (default: all).
        shapes: per column, the shape of one row's value (from the dataset's metadata); list columns without a
            shape are taken as 1-D, their length checked to be the same on every row.
        rank, size: this process's rank and the number of processes sharing the data.
        batch_size: rows per batch.
        shuffle: shuffle piece order and rows (within ``shuffle_buffer_rows``) each epoch.
        seed: seed of the shuffles (epoch ``e`` of rank ``r`` uses ``(seed, e, r)``).
        shuffle_buffer_rows: rows mixed together (default: the shard, at most 65536 rows and at most
            ``DEFAULT_SHUFFLE_BYTES``, 256 MiB, of rows as stored, as the epoch's first row group measures them:
            ``transformation_fn`` runs after the shuffle, so an encoded image counts at its encoded size). Memory:
            the shuffle holds at most
            about 2 x this many rows (rows of row groups partly still in the buffer; where the row groups alive hold
            more than twice the buffer's rows, its rows are copied out and the row groups freed); a rank's reader
            then holds about ``2 * shuffle_buffer_rows * row_bytes + read_ahead_pieces * (row_group_bytes +
            batch_bytes) + prefetch * batch_bytes`` (``batch_bytes`` as ``transformation_fn`` returns a batch;
            benchmarks/data_kinds.py measures it against a budget).
        drop_last: only full batches (``floor(min_r R_r / batch_size)`` per epoch).
        transformation_fn: ``fn(pandas.DataFrame) -> pandas.DataFrame`` run on the rows of each batch, after the
            shuffle (list columns hold one numpy array per row; a batch's rows can come from several row groups);
            its output columns make the batch (arrays of one length per column are stacked to 2-D). Up to
            ``read_ahead_pieces`` batches are transformed at once on the pool of ``pool_type``. (Before: on each
            row group, before the shuffle; decoded images were then shuffled and gathered again: 224 x 224 images
            went through the pools at 0.35-0.55x a one-thread loop, benchmarks/RESULTS.md.)
        prefetch: batches read ahead on a thread (0: read on the caller's thread).
        read_ahead_pieces: row groups decoded at once on a thread pool (default ``min(4, cpu_count)``; 1: none).
        timeout_s: how long the caller waits for the read-ahead thread's next batch before raising.
        memory_pool: Arrow allocator for decoding (see :func:`resolve_memory_pool`).
        use_threads: let Arrow decode columns in parallel.
        kinds: per column, the :class:`~spark_hvd.data.metadata.ColumnSpec` kind (from the dataset's metadata);
            without it a column's kind comes from its Arrow type (a list column is then one fixed-shape array).
        ragged: how a ``"ragged"`` column (1-D arrays of varying length, e.g. token ids) is handed over:
            ``"pad"`` (default): a ``(rows, longest row of the batch)`` array padded with ``pad_value``, plus a
            column ``<name>_length`` of the rows' lengths (int64); ``"list"``: an object array of one 1-D array
            per row, for the caller's own collation.
        pad_value: the padding of ``ragged="pad"``.
        collate_fn: ``fn(batch) -> batch`` run on every batch (a dict of arrays by column) on the read-ahead
            thread: tokenising, padding, turning sparse rows into what the model takes. (Collating several batches
            on threads at once was tried and dropped: two tokenizers at once cost ~15% more CPU and were no faster
            here, sessions 3 and 5 of issue 25 in benchmarks/RESULTS.md.) Without ``transformation_fn``, shuffled
            batches are gathered up to 16 at once (about ``SLAB_BYTES``, 1 MiB, of rows) and handed on as views of
            that slab, which lives until its last batch goes.
        pool_type: ``"thread"`` (default), ``"process"`` or ``"auto"``: where ``transformation_fn`` runs;
            ``"auto"`` (the estimators' default) is ``"process"`` for a ``transformation_fn`` whose
            ``prefers_processes`` attribute is true (:class:`~spark_hvd.data.decode.ImageDecoder` with small outputs:
            half of its time per image is Python holding the GIL, so threads overlap little of it; see docs/data.md),
            else ``"thread"``. (Not the default here: a process pool started by a script needs the script's
            ``if __name__ == "__main__":`` guard, as any ``multiprocessing`` use does.) The
            ``read_ahead_pieces`` row groups under way are read on threads either way (Arrow releases the GIL);
            with ``"process"`` each batch's ``transformation_fn`` runs in one of ``read_ahead_pieces`` worker
            processes (for decoders that hold the GIL), the function travelling by cloudpickle, the transformed
            batch coming back through shared memory (``/dev/shm``; pickled where there is none or no room:
            :mod:`spark_hvd.data.process_pool`); the processes are started by the first epoch and kept for the
            next ones until :meth:`close` (or garbage collection). Memory stays bounded: at most
            ``read_ahead_pieces`` batches are in the pool, ``prefetch`` batches are queued.
        codecs: per encoded column of a petastorm dataset, its codec, dtype and shape
            (``spark_hvd.data.petastorm_dataset.dataset_codecs``); default: read from the Unischema in the
            directory's ``_common_metadata`` where there is one. Such a column is decoded into a ``(rows, *shape)``
            array of its dtype (``NdarrayCodec``, ``CompressedNdarrayCodec``, ``CompressedImageCodec``); a
            ``transformation_fn`` sees each row's decoded array, as petastorm hands them over.
        cache_pieces: keep every row group of the shard in memory, as read from the files (before
            ``transformation_fn``), once it was read: later epochs read nothing from the filesystem and shuffle and
            batch the same rows as they would have read (the estimators' ``inmemory_cache_all``). Memory: the
            shard's rows as decoded from Parquet, for the reader's lifetime.

    Column kinds in a batch: numbers as ``(rows, *shape)`` arrays (nested fixed-shape arrays included);
    ``"binary"`` and ``"string"`` columns as object arrays of Python ``bytes`` / ``str``; ``"ragged"`` as set
    by ``ragged``; ``"sparse"`` (Vectors stored sparse) as a ``scipy.sparse.csr_matrix`` of float32, built from
    the stored indices and values without a Python loop per row.

    Iterate with ``for batch in reader.epoch(e)`` (or ``iter(reader)``, which runs epoch 0, 1, ... in turn).
    """

    def __init__(
        self,
        path: str,
        *,
        filesystem: pyarrow.fs.FileSystem | None = None,
        columns: Sequence[str] | None = None,
        shapes: dict[str, tuple[int, ...]] | None = None,
        rank: int = 0,
        size: int = 1,
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer_rows: int | None = None,
        drop_last: bool = False,
        transformation_fn: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
        prefetch: int = 4,
        read_ahead_pieces: int | None = None,
        timeout_s: float = 600.0,
        memory_pool: str | pa.MemoryPool | None = "jemalloc",
        use_threads: bool = True,
        kinds: dict[str, str] | None = None,
        ragged: str = "pad",
        pad_value: float = 0,
        collate_fn: Callable[[Batch], Batch] | None = None,
        pool_type: str = "thread",
        codecs: dict[str, dict[str, Any]] | None = None,
        cache_pieces: bool = False,
    ) -> None:
        import pyarrow.dataset as ds

        if not 0 <= int(rank) < int(size):
            raise InvalidParamError(f"rank must be in [0, size), got rank={rank} size={size}")
        if int(batch_size) < 1:
            raise InvalidParamError(f"batch_size must be >= 1, got {batch_size}")
        if shuffle_buffer_rows is not None and int(shuffle_buffer_rows) < 1:
            raise InvalidParamError(f"shuffle_buffer_rows must be >= 1, got {shuffle_buffer_rows}")
        if timeout_s <= 0:
            raise InvalidParamError(f"timeout_s must be > 0, got {timeout_s}")
        self.path = path
        self.rank, self.size = int(rank), int(size)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.transformation_fn = transformation_fn
        self.prefetch = max(0, int(prefetch))
        cpus = os.cpu_count() or 1
        self.read_ahead_pieces = max(1, int(read_ahead_pieces if read_ahead_pieces is not None else min(4, cpus)))
        self.timeout_s = float(timeout_s)
        self.use_threads = bool(use_threads)
        self._pool = resolve_memory_pool(memory_pool)
        self._where = f"rank {self.rank} reading {path!r}"

        try:
            dataset = ds.dataset(path, format="parquet", filesystem=filesystem)
        except (FileNotFoundError, OSError) as e:
            raise ReaderError(f"{self._where}: cannot open the Parquet files: {e}") from e
        self.schema = dataset.schema
        names = list(self.schema.names)
        self.columns = list(columns) if columns is not None else names
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise ReaderError(f"{self._where}: columns {missing} not in the files (they have {names})")
        if ragged not in ("pad", "list"):
            raise InvalidParamError(f"ragged must be 'pad' or 'list', got {ragged!r}")
        self.ragged, self.pad_value = ragged, pad_value
        if pool_type not in ("auto", "thread", "process"):
            raise InvalidParamError(f"reader_pool_type must be 'auto', 'thread' or 'process', got {pool_type!r}")
        if pool_type == "auto":
            pool_type = "process" if getattr(transformation_fn, "prefers_processes", False) else "thread"
        self.collate_fn, self.pool_type = collate_fn, pool_type
        self._procs: Any = None
        if codecs is None:  # a petastorm dataset says in its _common_metadata how its binary columns are encoded
            from spark_hvd.data.petastorm_dataset import dataset_codecs

            codecs = dataset_codecs(path, filesystem, self.columns)
        self.codecs = {c: codecs[c] for c in self.columns if c in codecs}
        self.shapes = {c: tuple((shapes or {}).get(c, ())) for c in self.columns}
        self.kinds = {c: (kinds or {}).get(c) or arrow_kind(self.schema.field(c).type) for c in self.columns}
        for c, codec in self.codecs.items():
            self.shapes[c] = tuple(int(s) for s in codec["shape"])
            self.kinds[c] = "array" if self.shapes[c] else "scalar"
        if self.codecs and transformation_fn is not None:  # the user's fn sees decoded arrays, as petastorm's did
            from spark_hvd.data.petastorm_codecs import DecodingTransform

            self.transformation_fn = transformation_fn = DecodingTransform(transformation_fn, self.codecs)
        self._list_cols = {c for c in self.columns if self.kinds[c] in ("array", "vector") and c not in self.codecs}
        self._plain_rows = all(plain_type(self.schema.field(c).type) for c in self.columns)
        for c in self._list_cols:
            if not self.shapes[c]:
                self.shapes[c] = (-1,)

        self._fragments = sorted(dataset.get_fragments(), key=lambda f: f.path)
        pieces: list[Piece] = []
        max_rg = 1
        for fi, frag in enumerate(self._fragments):
            for rg in _row_groups(frag):
                if rg[1] > 0:
                    pieces.append(Piece(fi, rg[0], 0, rg[1], True))
                    max_rg = max(max_rg, rg[1])
        self._max_rows_per_read = max_rg
        self.total_rows = sum(p.num_rows for p in pieces)
        if self.total_rows < self.size:
            raise TooFewRowsError(f"{self._where}: {self.total_rows} rows for {self.size} ranks; some rank gets none")
        pieces = _split_until(pieces, self.size)
        shards = assign_pieces(pieces, self.size)
        self.pieces = shards[self.rank]
        self.shard_rows = sum(p.num_rows for p in self.pieces)
        rows = [sum(p.num_rows for p in s) for s in shards]
        if self.drop_last:
            self.steps_per_epoch = min(rows) // self.batch_size
            if self.steps_per_epoch == 0:
                raise TooFewRowsError(
                    f"{self._where}: the smallest shard has {min(rows)} rows, fewer than batch_size="
                    f"{self.batch_size} with drop_last=True"
                )
            self.rows_per_epoch = self.steps_per_epoch * self.batch_size
        else:
            self.rows_per_epoch = max(rows)
            self.steps_per_epoch = math.ceil(self.rows_per_epoch / self.batch_size)
        default_buf = max(self.batch_size, min(65536, self.shard_rows))
        self.shuffle_buffer_rows = int(shuffle_buffer_rows) if shuffle_buffer_rows else default_buf
        self._buffer_by_bytes = not shuffle_buffer_rows
        self._next_epoch = 0
        self._piece_cache: dict[Piece, Batch] | None = {} if cache_pieces else None

    # ------------------------------------------------------------------ construction from the store
    @classmethod
    def from_dataset(
        cls,
        store: Store,
        info: DatasetInfo | str,
        split: str = "train",
        columns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> BatchReader:
        """A reader of the ``"train"`` or ``"val"`` split of a dataset prepared by :func:`prepare_data`.

        ``info`` is the :class:`DatasetInfo` or its key; ``kwargs`` go to :class:`BatchReader`.
        """
        from spark_hvd.data.metadata import DatasetInfo

        if isinstance(info, str):
            info = DatasetInfo.load(store, info)
        if split not in ("train", "val"):
            raise InvalidParamError(f"split must be 'train' or 'val', got {split!r}")
        if split == "val" and not info.has_validation:
            raise InvalidParamError(f"dataset {info.key!r} has no validation split")
        path = info.train_path(store) if split == "train" else info.val_path(store)
        cols = list(columns) if columns is not None else list(info.columns)
        kinds = {n: c.kind for n, c in info.columns.items()}
        kwargs.setdefault("codecs", info.extra.get("codecs", {}))
        return cls(path, filesystem=store.pyarrow_filesystem(), columns=cols, shapes=info.shapes(), kinds=kinds,
                   **kwargs)

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._next_epoch
        self._next_epoch += 1
        return self.epoch(epoch)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The ``steps_per_epoch`` batches of epoch ``epoch`` (read ahead on a thread if ``prefetch > 0``)."""
        gen = self._batches(int(epoch))
        if self.prefetch == 0:
            return gen
        return self._prefetched(gen, int(epoch))

    def _prefetched(self, gen: Iterator[Batch], epoch: int) -> Iterator[Batch]:
        # a C queue (a put wakes a waiting get with no Python-level lock or condition on either side: less of
        # the GIL taken from a collate_fn's tokenizer at each hand-off) and a semaphore of ``prefetch`` slots
        q: queue.SimpleQueue = queue.SimpleQueue()
        slots = threading.Semaphore(self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                if slots.acquire(timeout=0.2):
                    q.put(item)
                    return True
            return False

        def work() -> None:
            try:
                for batch in gen:
                    if not put(batch):
                        return
                put(_END)
            except BaseException as e:  # handed to the consumer, raised there
                put(_Failure(e))

        thread = threading.Thread(target=work, name=f"spark_hvd-reader-r{self.rank}-e{epoch}", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = q.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise ReaderTimeoutError(
                        f"{self._where}: no batch from the read-ahead thread within {self.timeout_s:.0f} s "
                        f"(epoch {epoch}); is the filesystem reachable?"
                    ) from None
                slots.release()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise ReaderError(f"{self._where}: reading failed in epoch {epoch}: {item.exc}") from item.exc
                yield item
        finally:
            stop.set()
            thread.join(timeout=self.timeout_s)
            if thread.is_alive():  # pragma: no cover - a read stuck in the filesystem
                logger.warning("%s: the read-ahead thread did not stop within %.0f s", self._where, self.timeout_s)
            else:
                gen.close()  # stops the decoding pool of this epoch

    def close(self) -> None:
        """Stop the worker processes of ``pool_type="process"`` (kept across epochs; also stopped when the reader
        is garbage collected). A later epoch starts new ones."""
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.shutdown(wait=True, cancel_futures=True)

    def _batches(self, epoch: int) -> Iterator[Batch]:
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        need = self.rows_per_epoch
        sizes = [self.batch_size] * (need // self.batch_size)
        if need % self.batch_size:
            sizes.append(need % self.batch_size)
        if self.shuffle:  # gathered several at once where no transformation_fn copies them again (_owned)
            batches = shuffled_batches(self._shuffled_blocks(rng), sizes,
                                       SLAB_BYTES if self.transformation_fn is None else 0)
        else:
            batches = sequential_batches(self._passes(None), sizes)
        if self.transformation_fn is not None:
            batches = self._transformed(batches)
        ragged = [c for c, k in self.kinds.items() if k == "ragged"] if self.transformation_fn is None else []
        if self.ragged == "list":
            ragged = []
        if not ragged and self.collate_fn is None:
            yield from batches
            return
        # the next batch is gathered before this one is handed on: the consumer, woken by the hand-off, then finds
        # the GIL free at once (collate_fn's tokenizer releases it) instead of waking a second time for it
        batch = next(batches, None)
        while batch is not None:
            done = self._finish(batch, ragged)
            batch = next(batches, None)
            yield done

    def _finish(self, batch: Batch, ragged: list[str]) -> Batch:
        """A batch with its ragged columns padded and ``collate_fn`` applied."""
        for c in ragged:
            batch[c], batch[f"{c}_length"] = pad_ragged(batch[c], self.pad_value)
        if self.collate_fn is None:
            return batch
        out = self.collate_fn(batch)
        if not isinstance(out, dict):
            raise ReaderError(f"{self._where}: collate_fn must return a dict of arrays by column, got "
                              f"{type(out).__name__}")
        return out

    # ------------------------------------------------------------------ reading
    def _passes(self, rng: np.random.Generator | None) -> Iterator[Batch | None]:
        """Chunks of the shard, pass after pass (a ``None`` after each pass), pieces shuffled by ``rng``.

        Up to ``read_ahead_pieces`` pieces are decoded at once on a small thread pool (Arrow releases the GIL), and
        handed on in order: one row group's big list column decodes on one core, so this is what keeps every core
        busy, as a plain ``pyarrow.dataset`` scan does.
        """
        workers = self.read_ahead_pieces
        if workers <= 1:
            while True:
                order = rng.permutation(len(self.pieces)) if rng is not None else range(len(self.pieces))
                for i in order:
                    yield self._read(self.pieces[i])
                yield None
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"spark_hvd-read-r{self.rank}")
        try:
            while True:
                order = list(rng.permutation(len(self.pieces)) if rng is not None else range(len(self.pieces)))
                pending: collections.deque = collections.deque()
                nxt = 0
                while nxt < len(order) or pending:
                    while nxt < len(order) and len(pending) < workers:
                        pending.append(pool.submit(self._read, self.pieces[order[nxt]]))
                        nxt += 1
                    yield pending.popleft().result(timeout=self.timeout_s)
                yield None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # waits for at most the reads under way

    def _shuffled_blocks(self, rng: np.random.Generator) -> Iterator[Block]:
        """Blocks of row ids in shuffled order, over a buffer of chunks.

        Yields ``(chunks, bases, ids)``: ``ids`` index the concatenation of ``chunks`` (chunk c starts at
        ``bases[c]``). The pool of buffered ids is shuffled whenever it is full and the first ``len - cap/2`` are
        emitted, so each row is mixed with up to ``cap`` others; the whole pool is flushed at the end of each pass, so
        a pass emits exactly the shard.
        """
        cap = self.shuffle_buffer_rows
        chunks: list[Batch | None] = []
        bases: list[int] = []
        pool = np.empty(0, dtype=np.int64)
        next_base = 0
        for chunk in self._passes(rng):
            if chunk is None:
                rng.shuffle(pool)
                if len(pool):
                    yield chunks, np.asarray(bases, dtype=np.int64), pool
                chunks, bases, pool, next_base = [], [], np.empty(0, dtype=np.int64), 0
                continue
            n = num_rows(chunk)
            if n and not chunks and self._buffer_by_bytes:  # the first chunk of a pass says what a row weighs
                cap = max(self.batch_size, min(self.shuffle_buffer_rows, DEFAULT_SHUFFLE_BYTES * n // nbytes(chunk)))
            chunks.append(chunk)
            bases.append(next_base)
            pool = np.concatenate([pool, np.arange(next_base, next_base + n, dtype=np.int64)])
            next_base += n
            if len(pool) >= cap:
                rng.shuffle(pool)
                k = len(pool) - cap // 2
                yield list(chunks), np.asarray(bases, dtype=np.int64), pool[:k]
                pool = pool[k:].copy()
                # drop chunks none of whose rows are left in the pool
                if len(pool):
                    alive = np.unique(np.searchsorted(bases, pool, side="right") - 1)
                    keep = np.zeros(len(chunks), dtype=bool)
                    keep[alive] = True
                    for c in np.flatnonzero(~keep):
                        chunks[c] = None
                    held = sum(num_rows(chunks[c]) for c in alive)
                    if held > 2 * len(pool):  # a few rows keep many row groups alive: copy them out (bounded RSS)
                        chunks, pool = [compact(chunks, np.asarray(bases, dtype=np.int64), pool)], \
                            np.arange(len(pool), dtype=np.int64)
                        bases, next_base = [0], len(pool)
                else:
                    chunks = [None] * len(chunks)

    def _read(self, piece: Piece) -> Batch:
        """``piece``'s rows: from the files, or from memory where ``cache_pieces`` kept them (a new dict each time,
        so a caller that sets a key leaves the kept one as it was)."""
        cache = self._piece_cache
        if cache is None:
            return self._load(piece)
        kept = cache.get(piece)
        if kept is None:
            kept = cache[piece] = self._load(piece)
        return dict(kept)

    def _load(self, piece: Piece) -> Batch:
        frag = self._fragments[piece.file_index]
        try:
            table = frag.subset(row_group_ids=[piece.row_group]).to_table(
                columns=self.columns,
                batch_size=max(self._max_rows_per_read, 1024),
                use_threads=self.use_threads,
                memory_pool=self._pool,
            )
        except Exception as e:
            raise ReaderError(f"{self._where}: reading row group {piece.row_group} of {frag.path}: {e}") from e
        if not piece.whole:
            table = table.slice(piece.start, piece.num_rows)
        if self.transformation_fn is not None:  # shuffled and batched as stored; transformed per batch
            if self._plain_rows:  # numpy columns, as to_pandas would make them: gathered by np.take, no Arrow take
                return {c: table.column(c).to_numpy() for c in self.columns}
            return {ROWS: ArrowRows(table)}
        return {c: self._column(c, table.column(c)) for c in self.columns}

    def _column(self, name: str, chunked: Any) -> Any:
        arr = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
        n = len(arr)
        if arr.null_count:
            raise ReaderError(f"{self._where}: column {name!r} holds {arr.null_count} nulls")
        kind = self.kinds[name]
        if name in self.codecs:
            from spark_hvd.data.petastorm_codecs import decode_column

            codec = self.codecs[name]
            return decode_column(codec, arr, codec["dtype"], self.shapes[name], name, self._where)
        if kind == "sparse":
            return sparse_to_csr(arr, self.shapes[name])
        if kind == "ragged":
            values = arr.flatten()
            if values.null_count:
                raise ReaderError(f"{self._where}: column {name!r} holds lists with null elements")
            offsets = np.asarray(arr.offsets)
            offsets = offsets - offsets[0]  # a slice of a row group starts further on
            flat = values.to_numpy(zero_copy_only=False)
            return np.fromiter((flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)), dtype=object,
                               count=n)
        if name not in self._list_cols:
            return arr.to_numpy(zero_copy_only=False)  # numbers; bytes / str as an object array
        shape = self.shapes[name]
        values = arr
        level = 0
        while is_list(values.type):  # every nesting level: one length on every row
            if hasattr(values, "offsets") and len(values):
                lengths = np.diff(np.asarray(values.offsets))
                if lengths.min() != lengths.max():
                    raise ReaderError(
                        f"{self._where}: column {name!r} holds lists of lengths {lengths.min()}..{lengths.max()}"
                        + (f" at nesting level {level + 1}" if level else "") + ", expected one fixed length"
                    )
            values = values.flatten()
            level += 1
        if values.null_count:
            raise ReaderError(f"{self._where}: column {name!r} holds lists with null elements")
        flat = values.to_numpy(zero_copy_only=False)
        if shape[0] == -1:
            return flat.reshape(n, -1) if n else flat.reshape(0, 0)
        if flat.size != n * int(np.prod(shape)):
            raise ReaderError(f"{self._where}: column {name!r} holds {flat.size // max(n, 1)} values per row, "
                              f"expected shape {list(shape)}")
        return flat.reshape((n, *shape))

    def _transformed(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """``transformation_fn`` on each batch of stored rows, ``read_ahead_pieces`` batches at once on the pool
        (threads, or the worker processes of ``pool_type="process"``), handed on in order.

        Per batch, not per row group: the shuffle buffer holds rows as stored (an encoded image, not its decoded
        float32 tensor), nothing decoded is copied again to be shuffled or gathered, and a worker process sends
        back each batch as one contiguous array per column."""
        workers = self.read_ahead_pieces
        if self.pool_type == "process" and self._procs is None:
            # started once per reader, kept across epochs (a start costs each worker its imports: seconds)
            self._procs = TransformPool(self.transformation_fn, workers)
            weakref.finalize(self, self._procs.shutdown, wait=False, cancel_futures=True)
        recycle = None
        if self._procs is not None:
            pool, submit, recycle = None, lambda rows: self._procs.submit(rows, self._where), self._procs.recycle
        elif workers > 1:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"spark_hvd-transform-r{self.rank}")
            submit = lambda rows: pool.submit(self._transform, rows)  # noqa: E731
        else:
            for batch in batches:
                yield self._transform(_stored_rows(batch))
            return
        pending: collections.deque = collections.deque()
        try:
            for batch in batches:
                pending.append(submit(_stored_rows(batch)))
                if len(pending) >= workers:
                    yield from_shared(pending.popleft().result(timeout=self.timeout_s), self._where, recycle)
            while pending:
                yield from_shared(pending.popleft().result(timeout=self.timeout_s), self._where, recycle)
        finally:
            for future in pending:  # an epoch stopped early: what is done is dropped, the rest cancelled
                if not future.cancel() and future.done() and future.exception() is None:
                    discard(future.result())
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)  # waits for at most the batches under way

    def _transform(self, rows: Any) -> Batch:
        return frame_to_batch(self.transformation_fn(rows_to_frame(rows)), self._where)


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


def _stored_rows(batch: Batch) -> Any:
    """What ``transformation_fn``'s frame is made from (``columns.rows_to_frame``): the Arrow table of an
    :class:`ArrowRows` chunk, or the batch's numpy columns themselves."""
    return batch[ROWS].table if ROWS in batch else batch


def _row_groups(frag: Any) -> list[tuple[int, int]]:
    md = frag.metadata
    return [(i, md.row_group(i).num_rows) for i in range(md.num_row_groups)]


def _split_until(pieces: list[Piece], count: int) -> list[Piece]:
    """Split the largest pieces into row ranges until there are at least ``count`` (fewer row groups than ranks)."""
    if len(pieces) >= count:
        return pieces
    heap = [(-p.num_rows, i, p) for i, p in enumerate(pieces)]
    heapq.heapify(heap)
    serial = len(heap)
    while len(heap) < count and -heap[0][0] > 1:
        _, _, p = heapq.heappop(heap)
        half = p.num_rows // 2
        for q in (
            Piece(p.file_index, p.row_group, p.start, half, False),
            Piece(p.file_index, p.row_group, p.start + half, p.num_rows - half, False),
        ):
            heapq.heappush(heap, (-q.num_rows, serial, q))
            serial += 1
    return [p for _, _, p in heap]
