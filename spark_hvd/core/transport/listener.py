"""A listening socket that survives its clients: the accept loop shared by the KV service, the driver service
and the ring's mesh setup.

* ``accept()`` errors (EMFILE / ENFILE when file descriptors run out, ENOBUFS, ECONNABORTED...) are logged and
  retried with a growing pause; they never end the loop.
* Every accepted connection proves the job's secret (``FramedSocket.handshake``) in its own thread, under
  ``handshake_timeout_s``: before that nothing but the fixed-size handshake is read, so a silent or slow client
  costs one thread for a bounded time and never blocks other clients.
* At most ``max_pending`` connections may be unauthenticated at once; more are closed on arrival.
* A connection's thread ends with it; ``serve(framed, address)`` runs there once the peer is authenticated, and
  the connection is closed when it returns (unless it returns True: it kept the connection for itself).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.transport.wire import FramedSocket

logger = logging.getLogger(__name__)

MAX_PENDING = 64
HANDSHAKE_TIMEOUT_S = 10.0
_MAX_BACKOFF_S = 1.0


class Listener:
    """Accepts connections on ``sock`` (bound and listening) and serves authenticated ones.

    Args:
        sock: the listening socket (closed by ``stop``).
        secret: the job's secret, proven by every client.
        serve: called as ``serve(framed, "host:port")`` on the connection's own thread once the client proved the
            secret; the connection is closed when it returns, unless it returns True.
        name: thread names and log messages.
        max_pending: connections allowed to be unauthenticated at the same time.
        handshake_timeout_s: how long a client may take to prove the secret.
        wrap: makes the ``FramedSocket`` (or subclass) of an accepted socket; default a plain ``FramedSocket``.
        encrypt: the default ``FramedSocket``s encrypt their frames (every client must too; ``wire``).
    """

    def __init__(self, sock: socket.socket, secret: bytes, serve: Callable[[Any, str], bool | None], *,
                 name: str, max_pending: int = MAX_PENDING, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 wrap: Callable[[socket.socket, str], FramedSocket] | None = None, encrypt: bool = False) -> None:
        self.sock = sock
        self.secret = secret
        self.serve = serve
        self.name = name
        self.handshake_timeout_s = handshake_timeout_s
        self._wrap = wrap or (lambda conn, address: FramedSocket(conn, secret, f"connection from {address}", encrypt))
        #: connections dropped because they failed (or never finished) the handshake, or came over the cap
        self.rejected = 0
        #: accept() errors survived (EMFILE...)
        self.accept_errors = 0
        self._pending = threading.BoundedSemaphore(max_pending)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start accepting in a daemon thread."""
        self.sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.name}-accept", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0, close_connections: bool = True) -> None:
        """Stop accepting, close the listening socket and (``close_connections``) shut every connection still
        handshaking or being served down. Safe to call twice."""
        self._stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass
        with self._lock:
            conns = list(self._open) if close_connections else []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _count_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def _accept_loop(self) -> None:
        backoff = 0.01
        while not self._stopped.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopped.is_set() or self.sock.fileno() < 0:
                    return
                self.accept_errors += 1
                logger.warning("%s: accept() failed (%s); retrying in %.2fs", self.name, exc, backoff)
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            backoff = 0.01
            if not self._pending.acquire(blocking=False):
                self._count_rejected()
                logger.warning("%s: too many unauthenticated connections; dropped one from %s:%s", self.name,
                               addr[0], addr[1])
                conn.close()
                continue
            try:
                threading.Thread(target=self._connection, args=(conn, f"{addr[0]}:{addr[1]}"),
                                 name=f"{self.name}-conn", daemon=True).start()
            except RuntimeError:  # no more threads: treat like running out of descriptors
                self._pending.release()
                conn.close()
                self._stopped.wait(backoff)

    def _connection(self, conn: socket.socket, address: str) -> None:
        with self._lock:
            self._open.add(conn)
        framed = self._wrap(conn, address)
        kept = False
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                framed.handshake("server", self.handshake_timeout_s)
            except (AuthenticationError, PeerFailureError, OSError) as exc:
                self._count_rejected()
                logger.warning("%s: dropped %s before authentication: %s", self.name, address, exc)
                return
            finally:
                self._pending.release()
            if not self._stopped.is_set():
                kept = bool(self.serve(framed, address))
        except Exception:  # a bug in serve(): never take the listener down
            logger.exception("%s: error while serving %s", self.name, address)
        finally:
            with self._lock:
                self._open.discard(conn)
            if not kept:
                framed.close()

