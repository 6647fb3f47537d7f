"""The compiled ring loop over several arrays where they lie (``ringloop.run``'s ``segments``, what
``RingBackend.allreduce_fused`` runs over TCP) bit for bit against the Python loop on the same arrays packed into one:
random data over ragged array boundaries (arrays of one element, arrays a frame crosses, arrays the frames are cut
at: ``SEGMENT_CUT_BYTES``), every op, the 16-bit floats among the dtypes, frames tagged either way (libcrypto or
``cryptography``) or encrypted; and a frame across arrays whose tag fails is never reduced nor scattered."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends.ring import SEGMENT_CUT_BYTES, frame_spans, segment_cuts
from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.transport import ringloop
from spark_hvd.core.transport.tcp import PeerSocket
from spark_hvd.core.transport.wire import make_secret
from tests.helpers.ranks import on_threads
from tests.helpers.ring_loops import python_loop, socket_pair

pytestmark = pytest.mark.skipif(not ringloop.BUILT, reason="the compiled ring loop is not built here")

SUB = 16 * 1024  # bytes per frame: many frames across the small arrays


def _counts(itemsize: int, rng: np.random.Generator) -> list[int]:
    """Ragged array sizes (elements): single elements, a few under a frame, some a frame crosses, and some from
    ``SEGMENT_CUT_BYTES`` (their ends cut the frames), shuffled; ~300 KiB in all."""
    big = SEGMENT_CUT_BYTES // itemsize
    counts = [1, 1, 2, 3, 7, 64, 1000, SUB // itemsize, SUB // itemsize + 1, 3 * SUB // itemsize - 5, big, big + 3,
              2 * big + 1] + rng.integers(1, 700, 12).tolist()
    return [int(c) for c in rng.permutation(counts)]


def _data(dtype: str, rng: np.random.Generator, count: int) -> np.ndarray:
    if dtype in ("float16", "bfloat16"):  # any bit pattern: subnormals, infinities and NaNs among them
        bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        return bits.view(np.float16) if dtype == "float16" else bits
    if dtype.startswith("float"):
        return (rng.standard_normal(count) * 1e3).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


def _plan(p: int, bounds: list[int], cuts: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Ring position ``p`` of 2 (one reduce step, one gather step), as ``RingBackend._ring`` plans it."""
    def pieces(chunk: int) -> list[tuple[int, int]]:
        return frame_spans(bounds[chunk], bounds[chunk + 1], SUB, cuts)

    return pieces((p - 1) % 2), [(t, lo, hi) for t in range(2) for lo, hi in pieces((p - t - 2) % 2)]


def _on_two(call) -> None:
    def quiet(r: int) -> None:
        with np.errstate(all="ignore"):  # products and sums of random values overflow
            call(r)

    on_threads(2, quiet)


_OPS = [("float32", ReduceOp.SUM), ("float32", ReduceOp.AVERAGE), ("float16", ReduceOp.AVERAGE),
        ("bfloat16", ReduceOp.SUM), ("float64", ReduceOp.MIN), ("int32", ReduceOp.PRODUCT), ("uint8", ReduceOp.MAX),
        ("int64", ReduceOp.AVERAGE)]
# encryption seals and opens the same frames for every op: three of them
_CASES = [(dtype, op, tags) for dtype, op in _OPS for tags in ("libcrypto", "cryptography")] + [
    (dtype, op, "encrypted") for dtype, op in _OPS[1:4]]


@pytest.mark.parametrize("dtype, op, tags", _CASES)
def test_segments_reduce_where_they_lie_as_the_python_loop_packed(monkeypatch, dtype, op, tags):
    monkeypatch.setattr(ringloop, "MAC_MODE", 1 if tags == "libcrypto" else 2)
    bfloat16 = dtype == "bfloat16"
    rng = np.random.default_rng([len(dtype), list(ReduceOp).index(op)])
    counts = _counts(np.dtype("uint16" if bfloat16 else dtype).itemsize, rng)
    ranks = [[_data(dtype, rng, c) for c in counts] for _ in range(2)]
    item = ranks[0][0].itemsize
    total = sum(counts)
    half = (total + 1) // 2 * item
    cuts = segment_cuts(ranks[0])
    assert len(cuts) >= 4  # the frames are cut at the large arrays' ends
    plans = [_plan(r, [0, half, total * item], cuts) for r in range(2)]
    ends = (np.cumsum(counts) * item).tolist()
    assert sum(any(lo < e < hi for e in ends) for _, lo, hi in plans[0][1] + plans[1][1]) >= 4  # across arrays
    packed = [np.concatenate(arrays) for arrays in ranks]
    peers = socket_pair(tags == "encrypted")
    try:
        _on_two(lambda r: python_loop(peers[r], packed[r], *plans[r], op, bfloat16, SUB))
        scratch = [np.empty(2 * SUB, np.uint8) for _ in range(2)]
        _on_two(lambda r: ringloop.run(peers[r], peers[r], "test", np.empty(0, ranks[r][0].dtype), scratch[r][:SUB],
                                       *plans[r], 1, 2, op, 2, bfloat16=bfloat16, segments=ranks[r],
                                       gather=scratch[r][SUB:]))
    finally:
        for peer in peers:
            peer.sock.close()
    for r in range(2):
        np.testing.assert_array_equal(np.concatenate(ranks[r]).view(np.uint8), packed[r].view(np.uint8),
                                      err_msg=f"{dtype} {op.name} rank {r}")


def test_a_frame_across_arrays_that_fails_its_tag_is_neither_reduced_nor_scattered():
    # rank 1's stream: a reduce-step frame across three arrays (reduced where they lie), a gather-step frame across
    # the next ones with one bit flipped: AuthenticationError, the first arrays reduced, the others untouched
    a, b = socket.socketpair()
    secret = make_secret()
    sender, receiver = PeerSocket(a, secret, 0, 30), PeerSocket(b, secret, 1, 30)
    server = threading.Thread(target=receiver.handshake, args=("server", 10))
    server.start()
    sender.handshake("client", 10)
    server.join(20)
    segments = [np.arange(k, k + n, dtype=np.float32) for k, n in ((1, 5), (10, 300), (50, 7), (90, 100), (7, 4))]
    before = [s.copy() for s in segments]
    theirs = np.arange(416, dtype=np.float32) * 2
    reader = threading.Thread(target=lambda: [sender.send_data([part.view(np.uint8)], "test")
                                              for part in (theirs[:312], theirs[312:])])
    reader.start()
    raw = bytearray()
    while len(raw) < 416 * 4 + 2 * 25:
        raw += receiver.sock.recv(1 << 16)
    reader.join(20)
    raw[-10] ^= 0x01  # in the second frame's payload
    writer, tampered = socket.socketpair()
    receiver.sock.close()
    receiver.sock = tampered
    writer.sendall(bytes(raw))
    try:
        with pytest.raises(AuthenticationError, match="rank 1"):
            ringloop.run(receiver, receiver, "test", np.empty(0, np.float32), np.empty(2048, np.uint8), [],
                         [(0, 0, 312 * 4), (1, 312 * 4, 416 * 4)], 1, 2, ReduceOp.SUM, 2, segments=segments,
                         gather=np.empty(2048, np.uint8))
        np.testing.assert_array_equal(np.concatenate(segments[:3]), np.concatenate(before[:3]) + theirs[:312])
        for seg, old in zip(segments[3:], before[3:], strict=True):
            np.testing.assert_array_equal(seg, old)
    finally:
        for sock in (sender.sock, writer, tampered):
            sock.close()
