"""The TCP mesh: every pair of a job's ranks connected once, each connection authenticated (``peer.PeerSocket``).

Each rank accepts its higher-ranked peers on a ``Listener`` (concurrent handshakes, bounded in time, a cap on
unauthenticated connections, accept errors survived), so one silent client cannot stall the setup. The first frame
says the job id and the connecting rank; a connection that fails the handshake, names another job or an unexpected
rank is dropped and logged.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Sequence

from spark_hvd.core.errors import CollectiveTimeoutError, PeerFailureError, SparkHvdError
from spark_hvd.core.transport.listener import HANDSHAKE_TIMEOUT_S, Listener
from spark_hvd.core.transport.tcp.peer import HELLO, PeerSocket, ProtocolError

logger = logging.getLogger(__name__)

#: Mesh sockets ask for a send buffer of this size (the kernel doubles it), where ``net.core.wmem_max`` lets it be
#: more than the send buffer's autotuning reaches (``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default). A
#: link-bound sender wakes for POLLOUT each time a third of its buffer drained: at 2 Gbit/s with autotuning
#: (4 MiB) ~39 wake-ups per 64 MiB allreduce at np=2, with 8 MiB ~12 (the loop's iterations 66-72 -> ~52). Where
#: wmem_max is lower (Linux's default is 208 KiB), setting it would cap the buffer below autotuning's: left alone.
SEND_BUFFER_BYTES = 4 * 1024 * 1024


def open_listener(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port chosen by the OS."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(512)
    return listener


def send_buffer_bytes(wmem_max: int, autotuned_max: int) -> int:
    """The SO_SNDBUF a mesh socket asks for: ``SEND_BUFFER_BYTES`` capped at ``wmem_max`` (net.core.wmem_max), if
    the kernel then grants (twice that) more than the send buffer's autotuning could reach (``autotuned_max``,
    net.ipv4.tcp_wmem's maximum); else 0, for leave the buffer to autotuning (setting it turns autotuning off)."""
    wanted = min(SEND_BUFFER_BYTES, wmem_max)
    return wanted if 2 * wanted > autotuned_max else 0


@functools.cache
def _send_buffer_bytes() -> int:
    """``send_buffer_bytes`` for this network namespace's settings (0 where they cannot be read)."""
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            wmem_max = int(f.read())
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            autotuned_max = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0
    return send_buffer_bytes(wmem_max, autotuned_max)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; a larger send buffer where the system allows one (``SEND_BUFFER_BYTES``).

    The receive buffer is left to the kernel's autotuning (net.ipv4.tcp_rmem): setting SO_RCVBUF turns it off and
    caps it at net.core.rmem_max (4 MiB here), and with that cap (and SO_SNDBUF's) the ranks of a 16-64 MiB
    allreduce waited on each other's window updates: wall time 2-4x the CPU time, against 1.0-1.1x with
    autotuning (loaded probes, issue 12)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = _send_buffer_bytes()
    if size:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError:
            pass


def connect_mesh(rank: int, size: int, listener: socket.socket, addresses: Sequence[tuple[str, int]],
                 secret: bytes, job_id: str, timeout_s: float, encrypt: bool = False) -> dict[int, PeerSocket]:
    """Connect every pair of ranks once (rank i dials every lower rank, accepts every higher one); ``encrypt``:
    every frame on every connection is encrypted (``wire``), as every rank must say.

    Higher ranks are accepted concurrently by a ``Listener`` on ``listener`` (started first, closed on return),
    so dialling lower ranks, waiting for the higher ones and reading the lower ranks' acknowledgements cannot
    deadlock, and a silent or forged connection only costs its own thread.
    """
    deadline = time.monotonic() + timeout_s
    peers: dict[int, PeerSocket] = {}
    arrived: queue.SimpleQueue[tuple[int, PeerSocket]] = queue.SimpleQueue()
    done = threading.Lock()
    finished = False
    handshake_s = max(1.0, min(HANDSHAKE_TIMEOUT_S, timeout_s))

    def wrap(sock: socket.socket, address: str) -> PeerSocket:
        candidate = PeerSocket(sock, secret, -1, handshake_s, encrypt)
        candidate.peer = f"connection from {address}"
        return candidate

    def serve(candidate: PeerSocket, address: str) -> bool:
        """An authenticated higher rank: read which job and rank it is, hand it to the main thread."""
        _tune(candidate.sock)
        try:
            their_job, their_rank = candidate.recv_message("setup", HELLO).decode().rsplit("\n", 1)
            j = int(their_rank)
        except (SparkHvdError, ValueError) as exc:
            logger.warning("rank %d dropped a connection from %s during setup: %s", rank, address, exc)
            return False
        if their_job != job_id or not rank < j < size:
            logger.warning("rank %d dropped a connection from %s claiming job %r rank %d", rank, address,
                           their_job, j)
            return False
        with done:
            if finished:
                return False
            candidate.rank, candidate.peer = j, f"rank {j}"
            arrived.put((j, candidate))
            return True

    accepting = Listener(listener, secret, serve, name=f"spark-hvd-mesh-{rank}", handshake_timeout_s=handshake_s,
                         wrap=wrap)
    accepting.start()
    hello = f"{job_id}\n{rank}".encode()
    try:
        for j in range(rank):
            host, port = addresses[j]
            while True:
                try:
                    sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise PeerFailureError(f"setup: could not connect to rank {j} at {host}:{port}: {exc}",
                                               rank=j, operation="setup") from exc
                    time.sleep(0.05)
            _tune(sock)
            peer = PeerSocket(sock, secret, j, timeout_s, encrypt)
            peers[j] = peer
            peer.handshake("client", max(0.1, deadline - time.monotonic()))
            peer.sock.settimeout(timeout_s)
            peer.send_data([hello], "setup", HELLO)
        expected = set(range(rank + 1, size))
        while expected:
            left = deadline - time.monotonic()
            try:
                j, candidate = arrived.get(timeout=max(0.0, min(left, 0.5)))
            except queue.Empty:
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"setup: rank {rank} waited {timeout_s:.0f}s for rank(s) {sorted(expected)} to connect",
                        rank=min(expected), operation="setup") from None
                continue
            if j not in expected:
                logger.warning("rank %d dropped a second connection claiming rank %d", rank, j)
                candidate.close()
                continue
            candidate.timeout_s = timeout_s
            candidate.sock.settimeout(timeout_s)
            candidate.send_data([b"ok"], "setup", HELLO)
            peers[j] = candidate
            expected.discard(j)
        for j in range(rank):
            if peers[j].recv_message("setup", HELLO) != b"ok":
                raise ProtocolError(f"setup: rank {j} did not acknowledge the connection")
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    finally:
        with done:
            finished = True
        accepting.stop(close_connections=False)
        while True:
            try:
                arrived.get_nowait()[1].close()
            except queue.Empty:
                break
    return peers
