"""Cutting a rank's stream of chunks (row groups as read, a dict of arrays by column) into batches: in order, or
from blocks of shuffled row ids over a buffer of chunks, one ``np.take`` per chunk and column; and
:class:`ArrowRows`, the stored rows of a chunk waiting for ``transformation_fn``, which the same code slices,
gathers and concatenates as it does a column."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ROWS", "SLAB_BATCHES", "ArrowRows", "Block", "compact", "concat", "nbytes", "num_rows", "rows_of",
           "sequential_batches", "shuffled_batches"]

Batch = dict[str, Any]
#: (chunks, start row of each chunk, row ids in emission order) - see BatchReader._shuffled_blocks
Block = tuple[list[Batch | None], np.ndarray, np.ndarray]

#: the key of a chunk of stored rows (an :class:`ArrowRows`) waiting for ``transformation_fn``
ROWS = "__spark_hvd_rows__"


class ArrowRows:
    """Rows of an Arrow table as the shuffle and the batching handle a column: ``len``/``shape``, a slice or an
    index array of rows (``take``), concatenation (:func:`concat`)."""

    __slots__ = ("table",)

    def __init__(self, table: Any) -> None:
        self.table = table

    @property
    def shape(self) -> tuple[int]:
        return (self.table.num_rows,)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, rows: Any) -> ArrowRows:
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(self.table.num_rows)
            return ArrowRows(self.table.slice(start, max(0, stop - start)))
        return ArrowRows(self.table.take(rows))


def nbytes(batch: Batch) -> int:
    """Bytes held by a chunk's columns (bytes / str objects by their lengths; sparse matrices by their arrays)."""
    total = 1
    for v in batch.values():
        if isinstance(v, np.ndarray):
            total += v.nbytes + (sum(x.nbytes if isinstance(x, np.ndarray) else len(x) for x in v.ravel())
                                 if v.dtype == object else 0)
        elif isinstance(v, ArrowRows):
            total += v.table.nbytes
        else:  # a scipy sparse matrix
            total += v.data.nbytes + v.indices.nbytes + v.indptr.nbytes
    return total


def num_rows(batch: Batch) -> int:
    return rows_of(next(iter(batch.values()))) if batch else 0


def rows_of(v: Any) -> int:
    return v.shape[0] if not isinstance(v, np.ndarray) else len(v)  # a scipy sparse matrix has no len()


def concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if isinstance(parts[0], ArrowRows):
        import pyarrow as pa

        return ArrowRows(pa.concat_tables([p.table for p in parts]))
    import scipy.sparse

    return scipy.sparse.vstack(parts, format="csr")


def sequential_batches(chunks: Iterator[Batch | None], sizes: list[int]) -> Iterator[Batch]:
    """Cut a stream of chunks into batches of ``sizes`` (views where a batch lies inside one chunk)."""
    cur: Batch | None = None
    pos = 0
    for size in sizes:
        parts: list[Batch] = []
        got = 0
        while got < size:
            if cur is None or pos >= num_rows(cur):
                cur = next(chunks)
                while cur is None:  # end of a pass: the next one wraps around the shard
                    cur = next(chunks)
                pos = 0
            take = min(size - got, num_rows(cur) - pos)
            parts.append({k: v[pos : pos + take] for k, v in cur.items()})
            pos += take
            got += take
        if len(parts) == 1:
            yield parts[0]
        else:
            yield {k: concat([p[k] for p in parts]) for k in parts[0]}


def compact(chunks: list[Batch | None], bases: np.ndarray, ids: np.ndarray) -> Batch:
    """The rows ``ids`` of the concatenated chunks, copied once into one new chunk, in the order of their ids (the
    caller relabels them ``0..n-1`` and shuffles its pool before it emits from it again, so any order will do; one
    ``np.take`` per chunk and column straight into the new chunk: decoded images are copied once, not three times)."""
    sel = np.sort(ids)
    owner = np.searchsorted(bases, sel, side="right") - 1
    cuts = np.flatnonzero(np.diff(owner)) + 1
    out: Batch | None = None
    others: dict[str, list] = {}  # columns that are no numpy array (sparse matrices): gathered, then stacked
    for s, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(sel)]]), strict=True):
        chunk = chunks[owner[s]]
        local = sel[s:e] - bases[owner[s]]
        if out is None:
            out = {k: np.empty((len(sel), *v.shape[1:]), dtype=v.dtype) for k, v in chunk.items()
                   if isinstance(v, np.ndarray)}
        for k, v in chunk.items():
            if isinstance(v, np.ndarray):
                np.take(v, local, axis=0, out=out[k][s:e], mode="clip")  # "clip": no buffered copy; ids are ours
            else:
                others.setdefault(k, []).append(v[local])
    for k, parts in others.items():
        out[k] = concat(parts)
    return out


#: the most batches gathered at once by :func:`shuffled_batches` (``slab_bytes``)
SLAB_BATCHES = 16


def shuffled_batches(blocks: Iterator[Block], sizes: list[int], slab_bytes: int = 0) -> Iterator[Batch]:
    """Gather batches of ``sizes`` rows from blocks of shuffled row ids: one ``np.take`` per chunk and column.

    With ``slab_bytes``, consecutive batches of one size whose rows all lie in the front block are gathered together
    (at most ``SLAB_BATCHES`` of them and about ``slab_bytes`` of rows, an object column's objects included), one
    ``take`` per chunk and column for all of them, and handed on as views of the slab. The batches and their row
    order are the same as one at a time; what it saves is the numpy calls per chunk and batch (a batch of 64 short
    strings over 5 chunks cost ~30-80 us of the read-ahead thread, 3-7% of tokenising it).
    """
    pending: list[Block] = []
    avail = 0
    i = 0
    while i < len(sizes):
        size = sizes[i]
        while avail < size:
            block = next(blocks)
            pending.append(block)
            avail += len(block[2])
        k = _slab_count(pending[0], sizes, i, slab_bytes)
        if k > 1:
            chunks, bases, ids = pending[0]
            rows = k * size
            sel = np.sort(ids[:rows].reshape(k, size), axis=1).ravel()  # each batch's ids sorted, as one at a time
            if rows == len(ids):
                pending.pop(0)
            else:
                pending[0] = (chunks, bases, ids[rows:])
            avail -= rows
            i += k
            slab = _gather_unsorted(chunks, bases, sel)
            for j in range(k):
                yield {c: v[j * size : (j + 1) * size] for c, v in slab.items()}
            continue
        i += 1
        # take `size` ids from the front of the pending blocks
        out: Batch | None = None
        others: dict[str, list] = {}  # columns that are no numpy array (sparse matrices): gathered, then stacked
        filled = 0
        while filled < size:
            chunks, bases, ids = pending[0]
            take = min(size - filled, len(ids))
            sel = np.sort(ids[:take])
            if take == len(ids):
                pending.pop(0)
            else:
                pending[0] = (chunks, bases, ids[take:])
            owner = np.searchsorted(bases, sel, side="right") - 1
            cuts = np.flatnonzero(np.diff(owner)) + 1
            starts = np.concatenate([[0], cuts])
            ends = np.concatenate([cuts, [take]])
            for s, e in zip(starts, ends, strict=True):
                chunk = chunks[owner[s]]
                local = sel[s:e] - bases[owner[s]]
                if out is None:
                    out = {k: np.empty((size, *v.shape[1:]), dtype=v.dtype) for k, v in chunk.items()
                           if isinstance(v, np.ndarray)}
                for k, v in chunk.items():
                    if isinstance(v, np.ndarray):
                        np.take(v, local, axis=0, out=out[k][filled + s : filled + e], mode="clip")
                    else:
                        others.setdefault(k, []).append(v[local])
            filled += take
        avail -= size
        for k, parts in others.items():
            out[k] = concat(parts)
        yield out


def _slab_count(block: Block, sizes: list[int], i: int, slab_bytes: int) -> int:
    """How many batches from ``sizes[i]`` on to gather at once from ``block`` (see :func:`shuffled_batches`)."""
    if slab_bytes <= 0:
        return 1
    chunks, _, ids = block
    size = sizes[i]
    most = min(SLAB_BATCHES, len(ids) // size, len(sizes) - i)
    k = 1
    while k < most and sizes[i + k] == size:
        k += 1
    if k == 1:
        return 1
    first = next((c for c in chunks if c is not None), None)
    if first is None or not all(isinstance(v, np.ndarray) for v in first.values()):
        return 1  # sparse matrices, Arrow rows: one batch at a time
    row_bytes = sum(_row_bytes(v) for v in first.values()) or 1
    return max(1, min(k, slab_bytes // (size * row_bytes)))


def _row_bytes(v: np.ndarray) -> int:
    """Bytes of one row of column ``v``: its items, and for an object column the objects they point to (a slab
    keeps them alive until its last batch goes), estimated from its first 16 rows."""
    row = v.itemsize * int(np.prod(v.shape[1:]))
    if v.dtype == object and len(v):
        sample = v.ravel()[:16]
        row += int(sum(x.nbytes if isinstance(x, np.ndarray) else len(x) if isinstance(x, (bytes, str)) else 64
                       for x in sample) * int(np.prod(v.shape[1:])) / len(sample))
    return row


def _gather_unsorted(chunks: list[Batch | None], bases: np.ndarray, sel: np.ndarray) -> Batch:
    """The rows ``sel`` (any order) of the concatenated chunks, in that order: one fancy index per chunk and
    column, scattered into place."""
    owner = np.searchsorted(bases, sel, side="right") - 1
    order = np.argsort(owner, kind="stable")
    by_owner = owner[order]
    cuts = np.flatnonzero(np.diff(by_owner)) + 1
    out: Batch | None = None
    for s, e in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(sel)]]), strict=True):
        c = by_owner[s]
        dest = order[s:e]
        local = sel[dest] - bases[c]
        chunk = chunks[c]
        if out is None:
            out = {k: np.empty((len(sel), *v.shape[1:]), dtype=v.dtype) for k, v in chunk.items()}
        for k, v in chunk.items():
            out[k][dest] = v[local]
    return out
