"""The ring's pipelined exchange loop, compiled: ``_ringloop.c``, where it was built, with ``tcp.loop.RingExchange``
(the same frames in Python) as the fallback.

``pip install`` / ``make setup`` build the extension where a C compiler and Python's headers are found (Debian's
``build-essential`` and ``python3-dev``); elsewhere the build is skipped and every ring runs the Python loop. Both
loops speak the same frames, tags and run-ahead rule, so ranks may run either. What differs is the frame size: the
compiled loop's cost per frame is a few microseconds (no Python but for the tag) where the Python loop's is ~20-30,
so where every rank of a job has the compiled loop (agreed at setup, ``RingBackend``), rings split their chunks
into frames of at most ``FRAME_BYTES`` (issue 23's CPU per byte at the link-bound rate: np=2 across two simulated
hosts at 2 Gbit/s, 12 rounds interleaved, CPU per call per rank at 16 / 64 MiB: 7.5 / 27.0 ms against 9.3 / 34.8
for the Python loop and 9.4 / 33.1 for gloo, on the wire's floor).

The compiled loop reduces every element-wise op (SUM, AVERAGE, MIN, MAX, PRODUCT) of every dtype the ring takes
(float16/32/64, bfloat16, int8/16/32/64, uint8/16/32/64) with the same bits as the Python loop's numpy ufuncs
(float16 and bfloat16 widened to float32 and rounded back once, as ``spark_hvd.core.reduce`` does; checked bit for
bit in ``tests/core/test_ringloop_ops.py``), and runs any allgather step. ``SPARK_HVD_COMPILED_RING=false`` turns
it off on a rank (then its whole job uses the Python loop's frame size). It also runs a ring over several arrays as
one buffer (``segments``: ``RingBackend.allreduce_fused`` over TCP reduces a round's tensors where they lie, with no
fusion buffer; ``tests/core/test_ringloop_segments.py``). With encryption (``SPARK_HVD_ENCRYPT``) it
seals and opens frames as the Python loop does (``_ringloop.c``), by ``cryptography``'s ``encrypt_into`` /
``decrypt_into`` under the GIL (or, after a wait for the GIL, the system's libcrypto without it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.transport.tcp.loop import (
    RECV_LOWAT_MIN_BYTES,
    RECV_LOWAT_TAIL_BYTES,
    RUN_AHEAD_WAIT_MS,
    recv_lowat_cap,
    run_ahead_bytes,
)
from spark_hvd.core.transport.tcp.peer import PeerSocket, ProtocolError
from spark_hvd.core.transport.wire import _LENGTH, HEADER_SIZE, TAG_SIZE

try:
    from spark_hvd.core.transport import _ringloop
except ImportError:  # not built on this machine: every ring runs the Python loop
    _ringloop = None

logger = logging.getLogger(__name__)

#: Frames of a ring whose ranks all run the compiled loop are at most this large (the Python loop's are
#: ``tcp.FRAME_BYTES``): small enough to stay in a core's 2 MiB L2 cache from the kernel's copy to the send.
FRAME_BYTES = 512 * 1024

_OK, _TIMEOUT, _RECV_ERR, _SEND_ERR, _AUTH, _CONTROL, _SIZE, _EMPTY, _NOMEM, _RAISED, _CRYPTO = range(11)
#: the C loop's dtype codes (``enum dtype``); bfloat16 travels as a uint16 view with ``bfloat16=True``
_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
           np.dtype(np.uint32): 5, np.dtype(np.uint64): 6, np.dtype(np.float16): 7, np.dtype(np.int8): 9,
           np.dtype(np.uint8): 10, np.dtype(np.int16): 11, np.dtype(np.uint16): 12}
_BYTES, _BF16 = 4, 8
#: its reduction codes (``enum reduce_op``; AVERAGE sums, then divides at the last reduce step)
_OPS = {ReduceOp.SUM: 0, ReduceOp.AVERAGE: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3, ReduceOp.PRODUCT: 4}


#: whether the compiled loop was built here (``Settings.compiled_ring`` may still turn it off)
BUILT = _ringloop is not None
#: How the compiled loop tags frames: 0 (the default) with ``cryptography`` under the GIL (~22 GB/s here), and
#: without the GIL through the system's libcrypto (OpenSSL 3.0 here: ~8.7 GB/s) for a second after a wait for the
#: GIL (another thread of the process runs Python and would give it back only after its 5 ms switch interval, for
#: every frame); 1: always libcrypto; 2: always ``cryptography``. The tags are the same (AES-256-GCM); for tests.
MAC_MODE = 0


def supports(dtype: np.dtype, op: ReduceOp, bfloat16: bool, reduce_steps: int) -> bool:
    """Whether the compiled loop can run a ring of these steps on arrays of ``dtype`` reduced by ``op``."""
    if reduce_steps == 0:
        return True
    if bfloat16:
        return dtype == np.uint16 and op in _OPS
    return dtype in _DTYPES and op in _OPS


def run(out: PeerSocket, recv: PeerSocket, operation: str, flat: np.ndarray, scratch: np.ndarray,
        first: Sequence[tuple[int, int]], plan: Sequence[tuple[int, int, int]], reduce_steps: int, total_steps: int,
        op: ReduceOp, ranks: int, *, average: bool | None = None, bfloat16: bool = False,
        segments: list[np.ndarray] | None = None, gather: np.ndarray | None = None) -> None:
    """Run a ring's steps on ``flat`` (see ``RingBackend._ring``) with the compiled loop: send the byte ranges
    ``first`` ((lo, hi) pairs) to ``out``; receive frame i from ``recv`` as planned by ``plan[i]``, (step, lo,
    hi): steps below ``reduce_steps`` into ``scratch`` and reduced by ``op`` into ``flat``'s bytes lo:hi (with
    ``average``, by default where ``op`` is AVERAGE, divided by ``ranks`` at the last of them), later ones
    straight into place; a frame of a step before the last is sent on. ``bfloat16``: ``flat`` is the uint16 view
    of bfloat16 values. ``segments``: C-contiguous arrays that ``flat`` (then empty, of their dtype) stands for,
    their bytes one after the other as one buffer, each reduced where it lies (a frame across two of them is
    received into ``scratch`` and sent from ``gather``, each at least as large as such a frame). Raises what
    ``RingExchange.run`` raises, naming the peer at fault."""
    assert _ringloop is not None
    spans = np.array(first, dtype=np.int64).reshape(-1, 2)
    frames = np.array(plan, dtype=np.int64).reshape(-1, 3)
    ahead = run_ahead_bytes(out, recv)
    lowat_cap = recv_lowat_cap(recv, ahead)
    code = _BYTES if reduce_steps == 0 else _BF16 if bfloat16 else _DTYPES[flat.dtype]
    # AVERAGE (1) only where this ring divides: a reduce-scatter of an average leaves the division to its caller
    if average is None:
        average = op is ReduceOp.AVERAGE
    opcode = 1 if average else 0 if op is ReduceOp.AVERAGE else _OPS[op]
    sending, receiving = out._sending(), recv._receiving()
    if out.encrypt != recv.encrypt:
        raise ValueError("a ring encrypts on both of its connections or on neither")
    # encrypted: each direction's seal_into / open_into (``wire``), else its GMAC
    out_fn, in_fn = (sending.seal_into, receiving.open_into) if out.encrypt else (sending.gmac, receiving.gmac)
    stages: tuple = ()
    if out.encrypt:  # the peers' staging buffers, kept between calls (the loop would map fresh pages every call)
        largest = max(int((spans[:, 1] - spans[:, 0]).max(initial=0)),
                      int((frames[:, 2] - frames[:, 1]).max(initial=0)))
        stages = (out.stage("send", largest + TAG_SIZE), recv.stage("recv", largest + TAG_SIZE))
    timeout_ms = int(max(out.timeout_s, recv.timeout_s) * 1000)
    with out.send_lock:
        try:
            status, detail, sending.counter, receiving.counter, index, head, mid_send = _ringloop.ring(
                out.sock.fileno(), recv.sock.fileno(), out_fn, sending.data_key(), sending.counter,
                in_fn, receiving.data_key(), receiving.counter, flat.view(np.uint8), scratch, spans, frames,
                reduce_steps, total_steps, code, opcode, ranks, timeout_ms, ahead,
                RUN_AHEAD_WAIT_MS, lowat_cap, RECV_LOWAT_TAIL_BYTES, RECV_LOWAT_MIN_BYTES, MAC_MODE, int(out.encrypt),
                *stages, **({} if segments is None else {"segments": segments, "gather": gather}))
        except BaseException:  # a signal handler's exception (Ctrl-C), or the MAC's: the streams may stop mid-frame
            out.send_broken = recv.recv_broken = True
            raise
    if status == _OK:
        return
    if mid_send:  # a frame is half-sent: anything sent after it (an ABORT) would land inside it
        out.send_broken = True
    if status == _TIMEOUT:
        waiting = recv if detail == 0 else out
        raise waiting._fail(TimeoutError("no progress"), operation)
    if status == _SEND_ERR:
        out.send_broken = True
        raise out._fail(OSError(detail, os.strerror(detail)), operation)
    recv.recv_broken = True
    if status == _RECV_ERR:
        cause = ConnectionError("connection closed by peer") if detail == 0 else OSError(detail, os.strerror(detail))
        raise recv._fail(cause, operation)
    if status == _AUTH:
        logger.warning("dropped a frame from %s that failed its authentication check", recv.peer)
        raise AuthenticationError(f"a frame from {recv.peer} failed the HMAC check; connection dropped")
    if status == _EMPTY:
        raise AuthenticationError(f"an empty frame from rank {recv.rank}; connection dropped")
    if status == _SIZE:
        expected = int(frames[index, 2] - frames[index, 1])
        raise ProtocolError(
            f"{operation}: rank {recv.rank} sent {detail} bytes where {expected} were expected; the ranks called "
            "collectives in different orders or with different shapes")
    if status == _CONTROL:  # an ABORT (or a stray control frame): read it whole, blocking
        (length,) = _LENGTH.unpack_from(head)
        recv.recv_broken = False
        recv._control(length, head[_LENGTH.size:HEADER_SIZE], head[HEADER_SIZE:], operation)  # raises PeerAbort
        recv.recv_broken = True
        raise recv.unexpected(head[HEADER_SIZE:], operation)
    if status == _NOMEM:
        raise MemoryError(f"{operation}: the compiled ring loop found no memory for its send queue")
    raise RuntimeError(f"{operation}: libcrypto failed to tag a frame in the compiled ring loop")
