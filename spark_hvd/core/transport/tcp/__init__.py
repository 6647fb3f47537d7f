"""TCP transport of the ring backend: an authenticated full mesh between the ranks of a job, in three files.

- ``peer``: one connection (``PeerSocket``: the handshake's keys, typed frames, ABORT / BYE, liveness probes),
  ``PeerWatcher`` and ``SendWorker``;
- ``loop``: the ring's exchange loop in Python (``RingExchange``), the twin of the compiled one
  (``spark_hvd.core.transport.ringloop``, ``_ringloop.c``), and the frame sizes and run-ahead rule both follow;
- ``mesh``: connecting every pair of ranks once (``connect_mesh``) and tuning the sockets.

The names below are the transport's API; the benchmarks' per-frame timeline is ``loop.TRACE``.
"""

from spark_hvd.core.transport.tcp.loop import (
    FRAME_BYTES,
    RECV_LOWAT_BYTES,
    RECV_LOWAT_MIN_BYTES,
    RECV_LOWAT_TAIL_BYTES,
    RUN_AHEAD_BYTES,
    RUN_AHEAD_LOWAT,
    RUN_AHEAD_WAIT_MS,
    RUN_AHEAD_WINDOW,
    SUB_CHUNK_MIN_BYTES,
    SUB_CHUNKS,
    RingExchange,
    tcp_state,
)
from spark_hvd.core.transport.tcp.mesh import (
    SEND_BUFFER_BYTES,
    _send_buffer_bytes,
    _tune,
    connect_mesh,
    open_listener,
    send_buffer_bytes,
)
from spark_hvd.core.transport.tcp.peer import (
    ABORT,
    BYE,
    DATA,
    HELLO,
    INLINE_SEND_BYTES,
    LOSS_BASED_CONGESTION,
    MAX_CONTROL_FRAME,
    SPIN_MAX_BYTES,
    SPIN_S,
    PeerAbort,
    PeerSocket,
    PeerWatcher,
    ProtocolError,
    SendWorker,
)

__all__ = [
    "ABORT", "BYE", "DATA", "FRAME_BYTES", "HELLO", "INLINE_SEND_BYTES", "LOSS_BASED_CONGESTION",
    "MAX_CONTROL_FRAME", "RECV_LOWAT_BYTES", "RECV_LOWAT_MIN_BYTES", "RECV_LOWAT_TAIL_BYTES", "RUN_AHEAD_BYTES",
    "RUN_AHEAD_LOWAT", "RUN_AHEAD_WAIT_MS", "RUN_AHEAD_WINDOW", "SEND_BUFFER_BYTES", "SPIN_MAX_BYTES", "SPIN_S",
    "SUB_CHUNKS", "SUB_CHUNK_MIN_BYTES", "PeerAbort", "PeerSocket", "PeerWatcher", "ProtocolError", "RingExchange",
    "SendWorker", "_send_buffer_bytes", "_tune", "connect_mesh", "open_listener", "send_buffer_bytes", "tcp_state",
]
