"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys 2021; Horovod's ``hvd.Adasum``), written against the ``Backend`` interface so every backend runs it.

The pairwise operation, for two gradients ``a`` and ``b`` of one tensor::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its norm is ~0). Orthogonal gradients add; equal ones average; ``adasum(a, 0) = a``, so a
rank that has joined (it contributes zeros) changes nothing. Across N ranks the pairs combine in a binary tree:
level k combines the results of ranks ``v`` and ``v + 2^k`` for every ``v`` whose bit k is 0 (ranks 0+1, 2+3, ...
then (01)+(23), ...), the tree of Horovod's reference and of its MPI code. The dot products are taken per tensor:
several tensors fused into one collective are still combined each with its own coefficients.

How it runs (Horovod's vector-halving distance-doubling, VHDD): at level k a rank swaps half of the range it still
holds with its partner ``v ^ 2^k`` (the left one keeps the first half), so each rank computes the combination on
1/2^(k+1) of the elements only. The dot product and the two squared norms of each tensor are the sums of the
partial ones of the 2^(k+1) ranks of the block, which hold the tensor's two vectors between them; one small SUM
allreduce of float64 gives every block its sums, the same bits on every rank. After the last level every rank holds
a disjoint range of the result, and one allgather gives every rank all of it. The exchanges are ``alltoall`` calls
with a single non-empty destination, so the backend (ring, shared memory, MPI, torch.distributed) needs nothing new.

A rank count N that is not a power of two (Horovod refuses it on CPU): N = P + R with P the largest power of two
below N; the first 2R ranks pair up first, each even one hands its whole gradient to the odd one beside it, which
combines the pair (``recursive_doubling.steps``' plan), and the P that remain run the tree above; the even ones get
the result from the final allgather. The tree is then ((0+1) + 2) for N = 3: still a tree of pairwise Adasum, no
longer balanced.

Dtypes: float32 and float64 are combined in their own dtype (dot products in float64); float16 and bfloat16 are
widened to float32 for the whole collective (exact), and rounded once at the end. Integers are refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from spark_hvd.core.algorithms.recursive_doubling import steps
from spark_hvd.core.backend import Backend, ReduceOp
from spark_hvd.core.reduce import bf16_to_f32, f32_to_bf16, scale_inplace

_TINY = math.sqrt(np.finfo(np.float64).tiny)  # below this a squared norm counts as zero (Horovod's sqrt(DBL_MIN))

ADASUM_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def check_request(kind: str, dtype: np.dtype, bfloat16: bool, device: str, name: str) -> None:
    """Raise a clear error, on the calling rank before anything is sent, for what Adasum cannot reduce."""
    if kind != "allreduce":
        raise NotImplementedError(f"{kind} of '{name}': op=Adasum is supported by allreduce only")
    if device:
        raise NotImplementedError(f"allreduce of '{name}': op=Adasum runs on host memory only; this tensor is on "
                                  f"{device} (move it to the CPU first)")
    if not bfloat16 and np.dtype(dtype) not in ADASUM_DTYPES:
        raise TypeError(f"allreduce of '{name}': op=Adasum needs a floating-point tensor (float16, bfloat16, "
                        f"float32, float64), got {np.dtype(dtype)}")


def coefficients(dot: np.ndarray, left_sq: np.ndarray, right_sq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two scale factors of ``adasum(left, right)`` per tensor, from its dot product and squared norms."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cl = np.where(left_sq >= _TINY, 1.0 - dot / left_sq * 0.5, 1.0)
        cr = np.where(right_sq >= _TINY, 1.0 - dot / right_sq * 0.5, 1.0)
    return cl, cr


def plan(n: int) -> list[tuple[int, int] | None]:
    """Every rank's range of the result after the halving levels, as fractions of 2^L (L levels): (index, L) or
    None for a rank that sits out (it only sends its gradient and receives the result). The same on every rank."""
    p2 = 1 << (n.bit_length() - 1)
    levels = p2.bit_length() - 1
    out: list[tuple[int, int] | None] = []
    for rank in range(n):
        sit_out, _ = steps(rank, n)
        if sit_out is not None:
            out.append(None)
            continue
        virtual = rank // 2 if rank < 2 * (n - p2) else rank - (n - p2)
        out.append((virtual, levels))
    return out


class _Layout:
    """The fused tensors' boundaries in one flat array, and per-tensor sums of products over any range of it."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.count = len(sizes)

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(tensor, start, stop) of the non-empty parts of the tensors within ``[lo, hi)``."""
        b = self.bounds
        first = int(np.searchsorted(b, lo, side="right")) - 1
        out = []
        t = max(first, 0)
        while t < self.count and b[t] < hi:
            s, e = max(int(b[t]), lo), min(int(b[t + 1]), hi)
            if e > s:
                out.append((t, s, e))
            t += 1
        return out


_CHUNK = 32768  # float32 items widened at a time for the dot products (two float64 chunks stay in the L2 cache)


def _dots(mine: np.ndarray, theirs: np.ndarray) -> tuple[float, float, float]:
    """mine.theirs, |mine|^2, |theirs|^2, accumulated in float64 (float32 input widened chunk by chunk)."""
    if mine.dtype == np.float64:
        return float(np.dot(mine, theirs)), float(np.dot(mine, mine)), float(np.dot(theirs, theirs))
    wide_a, wide_b = np.empty(min(mine.size, _CHUNK)), np.empty(min(mine.size, _CHUNK))
    dot = mine_sq = their_sq = 0.0
    for lo in range(0, mine.size, _CHUNK):
        n = min(_CHUNK, mine.size - lo)
        a, b = wide_a[:n], wide_b[:n]
        np.copyto(a, mine[lo:lo + n])
        np.copyto(b, theirs[lo:lo + n])
        dot += float(np.dot(a, b))
        mine_sq += float(np.dot(a, a))
        their_sq += float(np.dot(b, b))
    return dot, mine_sq, their_sq


def _combine(work: np.ndarray, lo: int, theirs: np.ndarray, layout: _Layout, mine_left: bool,
             sums: np.ndarray | None) -> np.ndarray:
    """Per tensor in ``work[lo:lo+len(theirs)]``: the partial [dot, |left|^2, |right|^2] (``sums`` None), or, given
    the block's ``sums``, ``work = c_mine * work + c_theirs * theirs`` in place. Returns the partials."""
    hi = lo + theirs.size
    partial = np.zeros((layout.count, 3))
    for t, s, e in layout.segments(lo, hi):
        mine_part, their_part = work[s:e], theirs[s - lo:e - lo]
        if sums is None:
            dot, mine_sq, their_sq = _dots(mine_part, their_part)
            partial[t] = (dot, mine_sq, their_sq) if mine_left else (dot, their_sq, mine_sq)
            continue
        cl, cr = coefficients(sums[t, 0], sums[t, 1], sums[t, 2])
        c_mine, c_theirs = (cl, cr) if mine_left else (cr, cl)
        np.multiply(mine_part, mine_part.dtype.type(c_mine), out=mine_part)
        np.multiply(their_part, their_part.dtype.type(c_theirs), out=their_part)  # ours: received, used once
        mine_part += their_part
    return partial


def _send_to(backend: Backend, data: np.ndarray, dst: int | None) -> np.ndarray:
    """One pairwise transfer as an alltoall (every rank calls it): ``data`` to ``dst`` (None: nothing sent);
    returns what came in (empty when nothing did)."""
    splits = [0] * backend.size
    if dst is not None:
        splits[dst] = data.size
    else:
        data = data[:0]
    out, _ = backend.alltoall(np.ascontiguousarray(data), splits)
    return out if out.flags.writeable else out.copy()  # scaled in place by ``_combine``


def _allreduce_flat(work: np.ndarray, layout: _Layout, backend: Backend) -> None:
    """Adasum of ``work`` (float32 or float64, one dimension) across every rank of ``backend``, in place."""
    n, rank = backend.size, backend.rank
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    sit_out_to, partners = steps(rank, n)
    levels = p2.bit_length() - 1
    if rem:  # fold: the even one of each of the first R pairs hands its gradient to the odd one
        got = _send_to(backend, work, sit_out_to)
        if sit_out_to is None and rank < 2 * rem:  # the odd one: combine (even = left, this one = right)
            sums = _combine(work, 0, got, layout, mine_left=False, sums=None)
            _combine(work, 0, got, layout, mine_left=False, sums=sums)
    virtual = None if sit_out_to is not None else (rank // 2 if rank < 2 * rem else rank - rem)
    lo, hi = 0, work.size
    for k in range(levels):
        blocks = p2 >> (k + 1)
        if virtual is None:  # sits out: takes part in every collective with nothing
            _send_to(backend, work, None)
            backend.allreduce(np.zeros(blocks * layout.count * 3), ReduceOp.SUM)
            continue
        left = not virtual >> k & 1
        mid = lo + (hi - lo) // 2
        (klo, khi), (glo, ghi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        theirs = _send_to(backend, work[glo:ghi], partners[k])
        if theirs.size != khi - klo:  # pragma: no cover - every rank plans alike
            raise RuntimeError(f"Adasum level {k}: expected {khi - klo} elements from rank {partners[k]}, got "
                               f"{theirs.size}")
        sums = np.zeros((blocks, layout.count, 3))
        sums[virtual >> (k + 1)] = _combine(work, klo, theirs, layout, left, None)
        backend.allreduce(sums.reshape(-1), ReduceOp.SUM)
        _combine(work, klo, theirs, layout, left, sums[virtual >> (k + 1)])
        lo, hi = klo, khi
    ranges = [_range(work.size, spot) for spot in plan(n)]
    mine = ranges[rank]
    gathered = backend.allgather(np.ascontiguousarray(work[mine[0]:mine[1]] if mine else work[:0]))
    at = 0
    for piece in ranges:
        if piece is not None:
            width = piece[1] - piece[0]
            work[piece[0]:piece[1]] = gathered[at:at + width]
            at += width


def _range(count: int, spot: tuple[int, int] | None) -> tuple[int, int] | None:
    """The element range a rank holds after the halving levels (``plan``'s entry), halving as ``_allreduce_flat``
    does: bit 0 of the virtual rank picks the half first."""
    if spot is None:
        return None
    virtual, levels = spot
    lo, hi = 0, count
    for k in range(levels):
        mid = lo + (hi - lo) // 2
        lo, hi = (mid, hi) if virtual >> k & 1 else (lo, mid)
    return lo, hi


def allreduce(backend: Backend, bufs: Sequence[np.ndarray], bfloat16: bool = False) -> None:
    """Adasum of each of ``bufs`` (one dtype; float16/32/64, or bfloat16 as a uint16 view with ``bfloat16``)
    across every rank of ``backend``, in place; each buffer is one tensor with its own coefficients."""
    if backend.size == 1 or not bufs:
        return
    dtype = np.dtype(bufs[0].dtype)
    wide = bfloat16 or dtype == np.float16
    work_dtype = np.float32 if wide else dtype
    if not wide and dtype not in ADASUM_DTYPES:
        raise TypeError(f"Adasum needs floating-point arrays, got {dtype}")
    sizes = [b.size for b in bufs]
    if len(bufs) == 1 and not wide and bufs[0].flags.c_contiguous:  # one tensor: combined where it lies
        _allreduce_flat(bufs[0].reshape(-1), _Layout(sizes), backend)
        return
    work = np.empty(sum(sizes), work_dtype)
    at = 0
    for b in bufs:
        flat = b.reshape(-1)
        work[at:at + flat.size] = bf16_to_f32(flat) if bfloat16 else flat
        at += flat.size
    _allreduce_flat(work, _Layout(sizes), backend)
    at = 0
    for b in bufs:
        flat = b.reshape(-1)
        part = work[at:at + flat.size]
        if bfloat16:
            f32_to_bf16(part, flat)
        else:
            flat[...] = part
        at += flat.size


def group_allreduce(backend: Backend, bufs: Sequence[np.ndarray], prescale: float, postscale: float,
                    bfloat16: bool = False) -> tuple[tuple[str, float, float], ...]:
    """``HostGroup.allreduce`` for ``op=Adasum``: scale, combine, scale, each buffer in place; returns the
    timeline's phases."""
    for buf in bufs:
        scale_inplace(buf, prescale, bfloat16)
    t0 = time.perf_counter()
    allreduce(backend, bufs, bfloat16)
    t1 = time.perf_counter()
    for buf in bufs:
        scale_inplace(buf, postscale, bfloat16)
    return (("ALLREDUCE", t0, t1),)
