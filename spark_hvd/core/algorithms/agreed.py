"""A two-rank TCP allreduce that carries the ranks' agreement in its first frame: negotiation inside the data.

A speculative round (``spark_hvd.core.engine.speculation``) needs every rank to say whether it submitted exactly the
round every rank expected. Packed into the data as one more element (a flag that the reduction adds up), that
costs a copy of every tensor in and out; on shared memory the flag rides beside the tensor where it lies. Between
two ranks over TCP the flag goes as a header frame of its own, sent ahead of the data on the same connection, so
the data starts flowing at once and the early rank's link is not left idle while it waits for the late one (a
separate small exchange first would make it wait out the other rank's lag before the first data byte).

Both ranks read the other's header before the first data frame, and the other rank is the only one, so each knows
the outcome before it touches its array. A rank that agrees sends its first frames (up to ``EAGER_BYTES``) without
waiting, the rest once both headers said yes (from then on exactly as the ring: the rest of its first chunk at
once, each reduced frame as soon as it is reduced); a rank that does not agree sends its header alone. On a miss
the only data to move is the early frames of a rank that agreed, which land in scratch: nothing is reduced, the
rank that did submit the tensor keeps it bit for bit, and the rank that did not never reads or writes the array it
passed (a read-only stand-in of the right size and dtype is enough). A miss costs a round trip and at most
``EAGER_BYTES`` (a whole array up to ``PAIR_EXCHANGE_BYTES``) on the link.

Between more than two ranks this does not work as it stands: a rank learns the flags of ranks further round the
ring only after it has reduced data from its neighbour.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average, reduce_into
from spark_hvd.core.transport.tcp import PeerSocket, ProtocolError, RingExchange

#: The header frame: [agree (0/1), the array's size in bytes], little-endian int64.
_HEADER = np.dtype("<i8")
#: A rank that agrees sends this much of its data before it has the other's header (its early frames): enough
#: to keep its link busy while the other rank catches up (at 2 Gbit/s, 16 ms), and all a miss costs.
EAGER_BYTES = 4 * 1024 * 1024
#: In a job whose rings use the compiled loop's frames (``ringloop``) a rank sends no early frames: its header,
#: then the whole ring in the compiled loop once the answer is in, under the run-ahead rule from its first byte.
#: Early frames sent before the compiled loop took over went out of that rule's count (the rank ran 4 MiB ahead of
#: its peer): 16 MiB at np=2 across two simulated hosts at 2 Gbit/s took 71.2 ms against 70.1 with none (the
#: wire's floor), 64 MiB 281.7 against 280.7 (8 rounds interleaved, load ~1). Every rank of such a job uses this,
#: whichever loop it runs, so the frames a miss leaves to drain agree.
COMPILED_EAGER_BYTES = 0


def _header(agree: bool, nbytes: int) -> np.ndarray:
    return np.array([1 if agree else 0, nbytes], _HEADER)


def _pieces(lo: int, hi: int, sub: int) -> list[tuple[int, int]]:
    return [(at, min(hi, at + sub)) for at in range(lo, hi, sub)]


#: Runs the rest of a ring in the compiled loop (``ringloop.run`` bound to this exchange, ``flat`` and ``op``):
#: given the byte ranges to send first and the plan of received frames, (step, lo, hi) rows
CompiledRing = Callable[[list[tuple[int, int]], list[tuple[int, int, int]]], None]


def allreduce(exchange: RingExchange, rank: int, flat: np.ndarray, agree: bool, op: ReduceOp,
              bfloat16: bool, scratch: Callable[[int], np.ndarray], sub: int, pair: bool,
              compiled: CompiledRing | None = None, eager_bytes: int = EAGER_BYTES) -> bool:
    """Allreduce ``flat`` with the other of two ranks if both ``agree``; True then (``flat`` holds the result).

    ``agree`` False: ``flat`` is only a template (its size and dtype), never read or written. On a miss (either
    rank disagrees) nothing of ``flat`` changes on either rank and False is returned. ``exchange``: to and from
    the other rank (each frame handed over before the next is read, so one scratch frame is reused); ``rank``: 0
    or 1 (which half the ring reduces here); ``scratch(n)``: a reusable uint8 array of ``n`` bytes; ``sub``: the
    bytes per frame (identical on both ranks); ``pair``: exchange whole arrays (one round trip), else the two-step
    ring.

    What travels: each rank's header, then (only from a rank that agrees) its first frames, up to ``EAGER_BYTES``
    (whole arrays: all of it), sent before the other's header is here; once the headers said both agree, the rest
    of the first chunk at once and each reduced frame as soon as it is reduced, as the ring sends them.

    ``compiled`` (the ring only, in a job on the compiled loop's frames, which sends no early frames): the headers
    go in ``exchange``; once both said yes, the whole ring runs in the compiled loop (the same frames).
    ``eager_bytes``: how much an agreeing rank sends before the answer (the same on every rank:
    ``COMPILED_EAGER_BYTES`` in a job on the compiled loop's frames, whichever loop a rank runs).
    """
    nbytes = flat.nbytes
    peer, operation = exchange.recv_peer, exchange.operation
    mine = _header(agree, nbytes)
    theirs = np.zeros(2, _HEADER)
    raw = flat.view(np.uint8) if agree else None
    item = flat.itemsize
    if pair:  # the whole array each way, reduced once all of it is here
        out_spans = in_spans = _pieces(0, nbytes, sub)
        reduce_spans: list[tuple[int, int]] = []
        got = scratch(nbytes)
        eager_out = eager_in = len(out_spans)
    else:
        # the ring: chunk ``rank`` is reduced here (from the other's copy) and sent back; chunk ``1 - rank`` is
        # sent as it is and comes back reduced
        half = (flat.size + 1) // 2 * item  # even_bounds(size, 2): the larger part first
        chunks = [(0, half), (half, nbytes)]
        out_spans = _pieces(*chunks[1 - rank], sub)
        reduce_spans = _pieces(*chunks[rank], sub)
        in_spans = reduce_spans + out_spans  # the other's copy of chunk ``rank``, then chunk ``1 - rank`` reduced
        got = scratch(sub)
        early = -(-eager_bytes // sub)
        eager_out, eager_in = min(len(out_spans), early), min(len(reduce_spans), early)

    if compiled is not None and not pair:
        if eager_out or eager_in:
            raise ValueError("the compiled ring sends no early frames (eager_bytes=COMPILED_EAGER_BYTES)")
        exchange.run([memoryview(mine.view(np.uint8))], [memoryview(theirs.view(np.uint8))], lambda i: None)
        hit = _agreed(theirs, nbytes, peer, operation) and agree
        if hit:
            compiled(out_spans, [(0, lo, hi) for lo, hi in reduce_spans] + [(1, lo, hi) for lo, hi in out_spans])
        return hit

    def target(lo: int, hi: int, k: int) -> memoryview:
        """Where received frame k (1-based, after the header) lands: scratch, unless it is a result kept here (on
        the ring, the frames after the other's copy of chunk ``rank``)."""
        if pair:
            return memoryview(got[lo:hi])
        if raw is not None and k > len(reduce_spans):
            return memoryview(raw[lo:hi])
        return memoryview(got[:hi - lo])

    receives = [memoryview(theirs.view(np.uint8))]
    receives += [target(lo, hi, k) for k, (lo, hi) in enumerate(in_spans, 1)]
    hit = [False]

    def on_received(i: int) -> memoryview | list[memoryview] | None:
        if i == 0:
            peer_agrees = _agreed(theirs, nbytes, peer, operation)
            hit[0] = agree and peer_agrees
            if not hit[0]:  # a miss: only the frames the other sent before it knew are still to come (its early
                # frames, which land in scratch: its copy of chunk ``rank`` at most), nothing else
                del receives[1 + (eager_in if peer_agrees else 0):]
                return None
            return [memoryview(raw[lo:hi]) for lo, hi in out_spans[eager_out:]]  # type: ignore[index]
        if not hit[0] or i > len(reduce_spans):
            return None
        # the other's copy of a frame of chunk ``rank``: reduce it here, and send it back
        lo, hi = reduce_spans[i - 1]
        part = flat[lo // item:hi // item]
        reduce_into(part, np.frombuffer(receives[i], dtype=flat.dtype), op, bfloat16)
        if op is ReduceOp.AVERAGE:
            divide_average(part, 2, bfloat16)
        return memoryview(raw[lo:hi])  # type: ignore[index]

    sends = [memoryview(mine.view(np.uint8))]
    if agree:
        sends += [memoryview(raw[lo:hi]) for lo, hi in out_spans[:eager_out]]  # type: ignore[index]
    # ``RingExchange`` reads ``receives[i]`` (and the list's length) only when frame i starts, after
    # ``on_received(i - 1)`` returned: the headers' answer may still shorten or redirect what follows them
    exchange.run(sends, receives, on_received)
    if hit[0] and pair:
        reduce_into(flat, got.view(flat.dtype), op, bfloat16)
        if op is ReduceOp.AVERAGE:
            divide_average(flat, 2, bfloat16)
    return hit[0]


def _agreed(theirs: np.ndarray, nbytes: int, peer: PeerSocket, operation: str) -> bool:
    """Whether the other rank agrees (its header ``theirs``); a header for another size is a protocol error."""
    if int(theirs[1]) != nbytes:
        peer.recv_broken = True
        raise ProtocolError(f"{operation}: rank {peer.rank} speculated on a round of {int(theirs[1])} bytes where "
                            f"this rank expected {nbytes}; the ranks' engines are out of step")
    return int(theirs[0]) == 1
