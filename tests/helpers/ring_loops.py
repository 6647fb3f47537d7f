"""The ring loops' test helpers: two handshaken ``PeerSocket`` ends of one socket pair, and the Python loop's
two-rank allreduce (``RingBackend._ring`` without the compiled loop) to check the compiled one against."""

from __future__ import annotations

import socket
import threading

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average, reduce_into
from spark_hvd.core.transport.tcp import PeerSocket, RingExchange
from spark_hvd.core.transport.wire import make_secret


def socket_pair(encrypt: bool = False) -> list[PeerSocket]:
    """[rank 0's end (its peer: rank 1), rank 1's end], handshaken."""
    a, b = socket.socketpair()
    secret = make_secret()
    peers = [PeerSocket(a, secret, 1, 30, encrypt), PeerSocket(b, secret, 0, 30, encrypt)]
    server = threading.Thread(target=peers[1].handshake, args=("server", 10))
    server.start()
    peers[0].handshake("client", 10)
    server.join(20)
    return peers


def python_loop(peer: PeerSocket, flat: np.ndarray, first: list, plan: list, op: ReduceOp, bfloat16: bool,
                frame: int) -> None:
    """A two-rank ring of ``flat`` (one reduce step, one gather step, frames of at most ``frame`` bytes) with the
    Python loop: reduced with ``reduce_into``, averaged at the last reduce step."""
    item, raw = flat.itemsize, flat.view(np.uint8)
    scratch = memoryview(np.empty(frame, np.uint8))
    receives = [scratch[:hi - lo] if t < 1 else memoryview(raw[lo:hi]) for t, lo, hi in plan]

    def received(i: int) -> memoryview | None:
        t, lo, hi = plan[i]
        if t < 1:
            part = flat[lo // item:hi // item]
            reduce_into(part, np.frombuffer(receives[i], dtype=flat.dtype), op, bfloat16)
            if op is ReduceOp.AVERAGE:
                divide_average(part, 2, bfloat16)
        return memoryview(raw[lo:hi]) if t + 1 < 2 else None

    RingExchange(peer, peer, "test").run([memoryview(raw[lo:hi]) for lo, hi in first], receives, received)
