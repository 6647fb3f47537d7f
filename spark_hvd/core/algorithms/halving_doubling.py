"""Recursive halving and doubling (Rabenseifner): a log-depth allreduce for large arrays, against the same peer
interface as ``spark_hvd.core.algorithms.recursive_doubling``.

The ring moves the bandwidth-optimal ``2 (N-1)/N`` of the array per member but takes 2(N-1) steps; recursive
doubling takes log2 N steps but moves the whole array at each. Rabenseifner's algorithm (MPICH's and gloo's
large-message allreduce) moves the same bytes as the ring in 2 log2 P steps: a reduce-scatter by recursive
halving (at step k a member swaps half of what it still reduces with the member whose position differs in bit
``log2 P - 1 - k``, and reduces the half it keeps), after which member ``v`` holds block ``v`` fully reduced, then
an allgather by recursive doubling (the blocks travel back the same way, doubling). With P members, P blocks of
equal size (the array is padded to a multiple of P when it must be, in a copy). A member count that is not a
power of two folds in first, as recursive doubling does (``recursive_doubling.steps``): the first 2R members pair
up, each even one hands its array to the odd one beside it and sits out, and each odd one hands the result back.

Every member ends with the same bits: each block is reduced on one member only and then copied as it is; AVERAGE
is a sum divided once, on the block's owner, before the allgather.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spark_hvd.core.algorithms.recursive_doubling import Peers, steps
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average, reduce_into


def scratch_bytes(count: int, itemsize: int, n: int) -> int:
    """The receive space ``allreduce`` needs for ``count`` items of ``itemsize`` bytes among ``n`` members."""
    p2 = 1 << (n.bit_length() - 1)
    block = -(-count // p2)
    return max(count, block * (p2 // 2)) * itemsize


def allreduce(flat: np.ndarray, op: ReduceOp, bfloat16: bool, members: Sequence[int], position: int,
              peers: Peers, scratch: np.ndarray) -> None:
    """Reduce ``flat`` (one-dimensional, contiguous) in place over ``members`` (global ranks; this one is
    ``members[position]``). ``scratch``: at least ``scratch_bytes(flat.size, flat.itemsize, len(members))``
    bytes (uint8) to receive into."""
    n = len(members)
    raw = flat.view(np.uint8)
    sit_out_to, partners = steps(position, n)
    if sit_out_to is not None:
        peers.send(members[sit_out_to], raw)
        peers.recv(members[sit_out_to], raw)
        return
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    folded = position < 2 * rem  # an odd member of the first 2R: it holds its even neighbour's array too
    if folded:
        theirs = scratch[:raw.nbytes]
        peers.recv(members[position - 1], theirs)
        reduce_into(flat, theirs.view(flat.dtype), op, bfloat16)
    virtual = position // 2 if folded else position - rem
    block = -(-flat.size // p2)
    work = flat
    if block * p2 != flat.size:  # P equal blocks: pad a copy (the padding is reduced and dropped)
        work = np.zeros(block * p2, flat.dtype)
        work[:flat.size] = flat
    wraw = work.view(np.uint8)
    bb = block * flat.itemsize  # bytes per block
    lo, hi = 0, p2  # the blocks this member still reduces
    for k in range(len(partners) - 1, -1, -1):  # halving: bit log2(P)-1 first
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if virtual >> k & 1 else ((lo, mid), (mid, hi))
        incoming = scratch[:(keep[1] - keep[0]) * bb]
        peers.exchange(members[partners[k]], wraw[give[0] * bb:give[1] * bb], incoming)
        reduce_into(work[keep[0] * block:keep[1] * block], incoming.view(flat.dtype), op, bfloat16)
        lo, hi = keep
    if op is ReduceOp.AVERAGE:
        divide_average(work[lo * block:hi * block], n, bfloat16)
    for k in range(len(partners)):  # doubling: the blocks travel back, bit 0 first
        width = hi - lo
        theirs_lo = lo - width if virtual >> k & 1 else hi
        peers.exchange(members[partners[k]], wraw[lo * bb:hi * bb], wraw[theirs_lo * bb:(theirs_lo + width) * bb])
        lo, hi = min(lo, theirs_lo), max(hi, theirs_lo + width)
    if work is not flat:
        flat[...] = work[:flat.size]
    if folded:
        peers.send(members[position - 1], raw)
