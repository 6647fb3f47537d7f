"""Authenticated framing for every socket of a job.

A frame is ``header | payload`` where the header holds the payload length and an HMAC-SHA256 over
(the connection's frame counter, the length, the payload) keyed with the job's secret. The receiver checks the
HMAC before it looks at the payload, so nothing unauthenticated is ever unpickled. The counter, kept per
direction by both ends, makes a replayed or reordered frame fail the check as well.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
from typing import Any

from spark_hvd.core.errors import AuthenticationError, PeerFailureError

logger = logging.getLogger(__name__)

SECRET_ENV = "SPARK_HVD_SECRET"
DIGEST_SIZE = hashlib.sha256().digest_size
_LENGTH = struct.Struct("!Q")
_COUNTER = struct.Struct("!Q")
HEADER_SIZE = _LENGTH.size + DIGEST_SIZE
MAX_OBJECT_FRAME = 1 << 30


def make_secret() -> bytes:
    """A fresh random per-job secret."""
    return secrets.token_bytes(32)


def secret_from_env(environ: dict[str, str] | None = None) -> bytes:
    """The job's secret from ``SPARK_HVD_SECRET`` (hex), as set by the launcher or the Spark runner."""
    value = (environ if environ is not None else os.environ).get(SECRET_ENV)
    if not value:
        raise AuthenticationError(f"{SECRET_ENV} is not set: every rank needs the job's secret to join.")
    return bytes.fromhex(value)


def sign(secret: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenation of ``parts`` (no copy of large buffers)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; a closed connection raises ``ConnectionError``."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        view = view[n:]


class FramedSocket:
    """A connected socket whose every frame is authenticated with the job's secret.

    ``peer`` is a human label (``"rank 3"``, ``"driver"``) used in error messages.
    """

    def __init__(self, sock: socket.socket, secret: bytes, peer: str = "peer") -> None:
        self.sock = sock
        self.secret = secret
        self.peer = peer
        self._sent = 0
        self._received = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send_bytes(self, *parts: bytes | memoryview) -> None:
        """Send one frame made of ``parts`` (scatter-gather, no concatenation)."""
        length = sum(memoryview(p).nbytes for p in parts)
        header = _LENGTH.pack(length)
        digest = sign(self.secret, _COUNTER.pack(self._sent), header, *parts)
        self._sent += 1
        try:
            self.sock.sendall(header + digest)
            for part in parts:
                self.sock.sendall(part)
        except OSError as exc:
            raise PeerFailureError(f"sending to {self.peer} failed: {exc}") from exc

    def _recv_header(self) -> tuple[int, bytes]:
        header = bytearray(HEADER_SIZE)
        try:
            recv_exactly(self.sock, memoryview(header))
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        (length,) = _LENGTH.unpack_from(header)
        return length, bytes(header[_LENGTH.size:])

    def _check(self, digest: bytes, length: int, payload: memoryview) -> None:
        expected = sign(self.secret, _COUNTER.pack(self._received), _LENGTH.pack(length), payload)
        self._received += 1
        if not hmac.compare_digest(expected, digest):
            logger.warning("dropped a frame from %s whose HMAC does not match the job's secret", self.peer)
            raise AuthenticationError(f"a frame from {self.peer} failed the HMAC check; connection dropped")

    def recv_bytes(self, max_size: int = MAX_OBJECT_FRAME) -> bytes:
        """Receive one frame and return its payload once its HMAC checked out."""
        length, digest = self._recv_header()
        if length > max_size:
            raise AuthenticationError(f"a frame from {self.peer} claims {length} bytes (> {max_size}); dropped")
        payload = bytearray(length)
        try:
            recv_exactly(self.sock, memoryview(payload))
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        self._check(digest, length, memoryview(payload))
        return bytes(payload)

    def recv_into(self, buffer: memoryview) -> None:
        """Receive one frame straight into ``buffer``, whose size must equal the frame's length."""
        buffer = memoryview(buffer).cast("B")
        length, digest = self._recv_header()
        if length != buffer.nbytes:
            raise AuthenticationError(
                f"a frame from {self.peer} has {length} bytes where {buffer.nbytes} were expected; dropped")
        try:
            recv_exactly(self.sock, buffer)
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        self._check(digest, length, buffer)

    def send_object(self, obj: Any) -> None:
        """Pickle ``obj`` and send it as one authenticated frame."""
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_object(self, max_size: int = MAX_OBJECT_FRAME) -> Any:
        """Receive one frame, check its HMAC, and only then unpickle it."""
        return pickle.loads(self.recv_bytes(max_size))
