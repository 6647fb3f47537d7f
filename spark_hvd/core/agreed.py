"""A two-rank TCP allreduce that carries the ranks' agreement in its first frame: negotiation inside the data.

A speculative round (``spark_hvd.core.speculation``) needs every rank to say whether it submitted exactly the
round every rank expected. Packed into the data as one more element (a flag that the reduction adds up), that
costs a copy of every tensor in and out; on shared memory the flag rides beside the tensor where it lies. Between
two ranks over TCP the flag goes as a header frame of its own, sent ahead of the data on the same connection, so
the data starts flowing at once and the early rank's link is not left idle while it waits for the late one (a
separate small exchange first would make it wait out the other rank's lag before the first data byte).

Both ranks read the other's header before the first data frame, and the other rank is the only one, so each knows
the outcome before it touches its array: on a hit the ring (or the pair exchange) runs as usual; on a miss both
still move every byte (the frame counts are fixed when the transfer starts, and the early data is already on its
way) but nothing is reduced and everything received goes to scratch, so the rank that did submit the tensor keeps
it bit for bit, and the rank that did not never reads or writes the array it passed (a read-only stand-in of the
right size and dtype is enough). The cost of a miss is one transfer of the array's size; the predictor arms a
round only once it has seen it twice, so misses are rare (a new pattern, a rank's idle heartbeat).

Between more than two ranks this does not work as it stands: a rank learns the flags of ranks further round the
ring only after it has reduced data from its neighbour.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average, reduce_into
from spark_hvd.core.tcp import PeerSocket, ProtocolError, RingExchange

#: The header frame: [agree (0/1), the array's size in bytes], little-endian int64.
_HEADER = np.dtype("<i8")


def _header(agree: bool, nbytes: int) -> np.ndarray:
    return np.array([1 if agree else 0, nbytes], _HEADER)


def _pieces(lo: int, hi: int, sub: int) -> list[tuple[int, int]]:
    return [(at, min(hi, at + sub)) for at in range(lo, hi, sub)]


def allreduce(peer: PeerSocket, rank: int, flat: np.ndarray, agree: bool, op: ReduceOp, bfloat16: bool,
              operation: str, scratch: Callable[[int], np.ndarray], sub: int, pair: bool) -> bool:
    """Allreduce ``flat`` with the other of two ranks if both ``agree``; True then (``flat`` holds the result).

    ``agree`` False: ``flat`` is only a template (its size and dtype), never read or written. On a miss (either
    rank disagrees) nothing of ``flat`` changes on either rank and False is returned. ``rank``: 0 or 1 (which
    half the ring reduces here); ``scratch(n)``: a reusable uint8 array of ``n`` bytes; ``sub``: the bytes per
    frame (identical on both ranks); ``pair``: exchange whole arrays (one round trip), else the two-step ring.
    """
    nbytes = flat.nbytes
    mine = _header(agree, nbytes)
    theirs = np.zeros(2, _HEADER)
    raw = flat.view(np.uint8) if agree else None
    zeros = None if agree else np.zeros(min(sub, nbytes), np.uint8)
    item = flat.itemsize
    if pair:  # the whole array each way, reduced once all of it is here
        spans = _pieces(0, nbytes, sub)
        got = scratch(nbytes)
        sends = [memoryview(raw[lo:hi] if raw is not None else zeros[:hi - lo]) for lo, hi in spans]
        receives = [memoryview(theirs.view(np.uint8))] + [memoryview(got[lo:hi]) for lo, hi in spans]
        outcome = [False]

        def on_pair(i: int) -> None:
            if i == 0:
                outcome[0] = _agreed(theirs, agree, nbytes, peer, operation)

        RingExchange(peer, peer, operation).run([memoryview(mine.view(np.uint8)), *sends], receives, on_pair)
        if not outcome[0]:
            return False
        reduce_into(flat, got.view(flat.dtype), op, bfloat16)
        if op is ReduceOp.AVERAGE:
            divide_average(flat, 2, bfloat16)
        return True
    # the ring: chunk ``rank`` is reduced here (from the other's copy) and sent back; chunk ``1 - rank`` is sent
    # as it is and comes back reduced
    half = (flat.size + 1) // 2 * item  # even_bounds(size, 2): the larger part first
    chunks = [(0, half), (half, nbytes)]
    out_lo, out_hi = chunks[1 - rank]
    in_lo, in_hi = chunks[rank]
    buf = scratch(sub)
    reduce_spans = _pieces(in_lo, in_hi, sub)
    gather_spans = _pieces(out_lo, out_hi, sub)
    sends = [memoryview(raw[lo:hi] if raw is not None else zeros[:hi - lo]) for lo, hi in gather_spans]
    receives = [memoryview(theirs.view(np.uint8))]
    receives += [memoryview(buf[:hi - lo]) for lo, hi in reduce_spans]
    receives += [memoryview(raw[lo:hi] if raw is not None else buf[:hi - lo]) for lo, hi in gather_spans]
    n_reduce = len(reduce_spans)
    hit = [False]

    def on_ring(i: int) -> memoryview | None:
        if i == 0:
            hit[0] = _agreed(theirs, agree, nbytes, peer, operation)
            if not hit[0] and raw is not None:  # a miss: what comes back must not land in the array
                for k, (lo, hi) in enumerate(gather_spans):
                    receives[1 + n_reduce + k] = memoryview(buf[:hi - lo])
            return None
        if i > n_reduce:
            return None
        lo, hi = reduce_spans[i - 1]
        if not hit[0]:
            return memoryview(raw[lo:hi] if raw is not None else zeros[:hi - lo])
        part = flat[lo // item:hi // item]
        reduce_into(part, np.frombuffer(receives[i], dtype=flat.dtype), op, bfloat16)
        if op is ReduceOp.AVERAGE:
            divide_average(part, 2, bfloat16)
        return memoryview(raw[lo:hi])

    # ``RingExchange`` reads ``receives[i]`` only when frame i starts, after ``on_ring(i - 1)`` returned: the
    # header's answer may still redirect the frames that follow it
    RingExchange(peer, peer, operation).run([memoryview(mine.view(np.uint8)), *sends], receives, on_ring)
    return hit[0]


def _agreed(theirs: np.ndarray, agree: bool, nbytes: int, peer: PeerSocket, operation: str) -> bool:
    if int(theirs[1]) != nbytes:
        peer.recv_broken = True
        raise ProtocolError(f"{operation}: rank {peer.rank} speculated on a round of {int(theirs[1])} bytes where "
                            f"this rank expected {nbytes}; the ranks' engines are out of step")
    return agree and int(theirs[0]) == 1
