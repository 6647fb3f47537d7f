"""Rounds of new names in one collective: speculation on a round's layout rather than its names.

A round of tensors no rank has negotiated before (a name made up per step, ``allreduce(metric)`` without a name,
which gets a new ``allreduce.noname.N`` every call) costs a fast round and then the data: two collectives, even when
every rank submitted the same (``spark_hvd.core.engine.table.same_messages``). When the ranks have agreed twice in a row
on a round of new small float tensors with the same *layout* (the same metadata in the same order, only the names
differ), they expect the next round to be one too, and run it as one allreduce of::

    [flag, name digests (3 slots per rank), tensors...]

Every rank whose submissions have that layout packs a flag of 1, the digest of its names (60 bits in three
float slots of 20 bits, each slot one rank's alone, so the sum is exact) and its tensors; any other rank zeros.
When every flag is set and every rank's names digest alike, every rank submitted the same names with the same
metadata, which is all a negotiation would have established, and the packed part is the answer. Otherwise every
rank drops it (the tensors were packed copies: nothing of theirs changed), disarms and negotiates as usual, having
spent one small collective. Names agreed this way stay out of the response cache (a name made up per call would
only evict the names a loop reuses; one that comes back is negotiated then). Like the table and
``spark_hvd.core.engine.speculation``, this is thread-free and rank-free: every rank arms the same ``FreshSpec`` from
the same agreed rounds.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.negotiation import Meta
from spark_hvd.core.engine.speculation import SPEC_BYTES
from spark_hvd.core.reduce import scale_inplace

Layout = tuple[Meta, ...]
_SLOTS = 3  # digest slots per rank, 20 bits each (float32 holds integers up to 2**24 exactly)


class FreshSpec(NamedTuple):
    """The expected layout of the next round and its staging array ``[flag, digests, tensors...]``."""

    layout: Layout
    dtype: np.dtype
    op: ReduceOp
    prescale: float
    postscale: float
    size: int
    staging: np.ndarray
    views: tuple[np.ndarray, ...]  # each tensor's place in ``staging``, in its shape
    head: memoryview  # ``[flag, digests]`` of ``staging``: single items are written and read faster than numpy's
    blank: memoryview  # zeros of the head's length
    sole: tuple | None  # a layout of one tensor: (op, shape, dtype, prescale, postscale), what a call must match

    @property
    def data(self) -> np.ndarray:
        """The tensors' part of ``staging``."""
        return self.staging[1 + _SLOTS * self.size:]


def fresh_layout(metas: Sequence[Meta]) -> Layout | None:
    """The layout of a round of new tensors with these metadata, or None when such a round cannot be packed:
    host allreduces of one float32/float64 dtype, SUM or AVERAGE, one scaling, at most ``SPEC_BYTES`` in all."""
    if not metas:
        return None
    first = metas[0]
    key = (first.dtype, first.op, first.prescale, first.postscale)
    if first.op not in ("sum", "average") or np.dtype(first.dtype) not in (np.float32, np.float64):
        return None
    count = 0
    for m in metas:
        if m.kind != "allreduce" or m.device or m.bfloat16 or (m.dtype, m.op, m.prescale, m.postscale) != key:
            return None
        count += int(np.prod(m.shape, dtype=np.int64))
    if count * np.dtype(first.dtype).itemsize > SPEC_BYTES:
        return None
    return tuple(metas)


def build_fresh(layout: Layout, size: int) -> FreshSpec:
    """The speculation for a round of ``layout`` among ``size`` ranks."""
    first = layout[0]
    dtype = np.dtype(first.dtype)
    counts = [int(np.prod(m.shape, dtype=np.int64)) for m in layout]
    head = 1 + _SLOTS * size
    staging = np.zeros(head + sum(counts), dtype)
    views, offset = [], head
    for m, n in zip(layout, counts, strict=True):
        views.append(staging[offset:offset + n].reshape(m.shape))
        offset += n
    op = ReduceOp(first.op)
    sole = (op, first.shape, dtype, first.prescale, first.postscale) if len(layout) == 1 else None
    return FreshSpec(layout, dtype, op, first.prescale, first.postscale, size, staging, tuple(views),
                     memoryview(staging)[:head], memoryview(np.zeros(head, dtype)), sole)


def name_digest(names: Sequence[str]) -> tuple[int, int, int]:
    """60 bits of a digest of ``names`` as three integers in [2**20, 2**21) (never zero, exact in float32)."""
    return _digest(names[0] if len(names) == 1 else "\0".join(names))


def _digest(text: str) -> tuple[int, int, int]:
    # 20 bits from each of the first three 32-bit words of BLAKE2b (its default size: no keyword to parse)
    a, b, c = _three_words(_blake2b(text.encode()).digest())
    return a & 0xFFFFF | 0x100000, b & 0xFFFFF | 0x100000, c & 0xFFFFF | 0x100000


_blake2b = hashlib.blake2b
_three_words = struct.Struct("<3I").unpack_from


def pack(spec: FreshSpec, rank: int, names: Sequence[str] | None, bufs: Sequence[np.ndarray] | None) -> None:
    """Fill ``spec.staging`` with this rank's part: flag, digest and tensors, or zeros (``names`` None: this rank
    submitted something else)."""
    if names is None or bufs is None:
        spec.staging.fill(0)
        return
    if len(names) == 1 and len(bufs) == 1:
        pack_one(spec, rank, names[0], bufs[0])
        return
    _pack_head(spec, rank, "\0".join(names))
    for view, buf in zip(spec.views, bufs, strict=True):
        view[...] = buf
    if spec.prescale != 1.0:
        scale_inplace(spec.data, spec.prescale)


def pack_one(spec: FreshSpec, rank: int, name: str, buf: np.ndarray) -> None:
    """``pack`` of one tensor (the blocking ``allreduce``'s round): the same staging, fewer steps."""
    _pack_head(spec, rank, name)
    spec.views[0][...] = buf
    if spec.prescale != 1.0:
        scale_inplace(spec.data, spec.prescale)


def _pack_head(spec: FreshSpec, rank: int, text: str) -> None:
    head = spec.head
    head[:] = spec.blank  # the tensors' part is overwritten whole by the caller
    head[0] = 1.0
    at = 1 + _SLOTS * rank
    head[at], head[at + 1], head[at + 2] = _digest(text)


def agreed(spec: FreshSpec) -> bool:
    """After the allreduce of ``spec.staging``: did every rank submit this layout under the same names?"""
    size = spec.size
    head = spec.head.tolist()  # small: plain Python is faster than numpy here
    if spec.op is ReduceOp.AVERAGE:  # AVERAGE divided every slot by the size
        head = [round(x * size) for x in head]
    if not head[0] > size - 0.5:
        return False
    mine = head[1:1 + _SLOTS]
    return mine[0] > 0 and head[1:] == mine * size  # every rank's slots hold this rank's digest


def unpack(spec: FreshSpec, bufs: Sequence[np.ndarray]) -> None:
    """Copy the reduced tensors (postscaled) back into ``bufs``."""
    if spec.postscale != 1.0:
        scale_inplace(spec.data, spec.postscale)
    for view, buf in zip(spec.views, bufs, strict=True):
        buf[...] = view
