"""Authenticated framing for every socket of a job (ring mesh, KV rendezvous, driver service).

**Handshake.** Before any frame, the two ends of a connection run a challenge-response on the job's secret ``S``
(fixed-size messages, so nothing before it is length-prefixed)::

    client -> server   MAGIC | Nc                                   (Nc: 32 fresh random bytes)
    server -> client   MAGIC | Ns | HMAC(S, "server" | Nc | Ns)     (Ns: 32 fresh random bytes)
    client -> server   HMAC(S, "client" | Nc | Ns)

Each end checks the other's proof before it reads anything else; the "client"/"server" labels stop one end's proof
from being reflected as the other's. Both ends then derive a key per direction, ``HMAC(S, "c2s"|Nc|Ns)`` and
``HMAC(S, "s2c"|Nc|Ns)``, so keys are fresh for every connection even when one end's nonce is replayed. The side
that speaks first is the client: ``handshake()`` runs explicitly, or lazily on the first send (client) or the first
receive (server).

**Frames.** A frame is ``length (8 bytes) | tag (16 bytes) | payload``. The tag covers the direction's frame
counter, the length and the payload, and is checked before the payload is used:

* control frames (everything that is ever unpickled): HMAC-SHA256 with the direction key, truncated to 128 bits;
* data frames (raw collective payloads, ``fast=True``, never unpickled): the tag of AES-256-GCM (NIST SP 800-38D)
  under the direction's data key ``HMAC(direction key, "spark_hvd data frames")``, with the frame counter as nonce,
  the payload (the frame's last part) as associated data and ``length | the other parts`` (the type byte) as the
  plaintext, whose ciphertext is dropped: only the 16-byte tag is sent. Over the payload this is GMAC, a one-time
  polynomial MAC like Poly1305; the counter never repeats on a direction, so no nonce is reused under a key. The
  payload is not encrypted (no copy): the cost is GHASH's, ~22 GB/s on one core here (carry-less multiply
  instructions: x86-64 PCLMULQDQ/VPCLMULQDQ, ARMv8 PMULL), where ChaCha20-Poly1305's tag (the previous design) ran
  at ~12 GB/s and HMAC-SHA256 at ~1.4 GB/s; at N=2 a 64 MiB allreduce tags 64 MiB and checks 64 MiB per rank, so
  the MAC was the largest single CPU cost of a link-bound ring (issue 23). One AEAD object per direction, reused
  (a frame's fixed cost ~3 us).

**Encryption (an option).** With ``encrypt=True`` on both ends (``SPARK_HVD_ENCRYPT=1``: ``JobEnv.encrypt``,
``run(encrypt=True)``, ``spark-hvd-run --encrypt``) every frame, control or data, is AES-256-GCM under the
direction's frame key ``HMAC(direction key, "spark_hvd encrypted frames")``, the nonce the frame counter as above:
the associated data is ``length`` and the frame's clear prefix (the type byte of a ``PeerSocket``'s frames, which a
receiver peeks at before reading a frame; nothing for other sockets), the plaintext the rest of the payload, and
the ciphertext is sent in its place (same length), the 16-byte tag where it always is. The counter never repeats
on a direction, so no nonce is reused under a key. The mode is part of the handshake: an end that encrypts says
``ENCRYPTED_MAGIC`` where the other says ``MAGIC``, and both proofs cover the mode, so two ends that disagree (or a
relay that rewrites the hello) fail the handshake with an error that says which end encrypts, and nothing is sent
in clear to an end that expects ciphertext. A frame is decrypted from a copy of its ciphertext with the tag after
it (``cryptography``'s ``decrypt_into`` where it has one) straight into the buffer it was received for, so a
payload is never used before its tag checked out, as without encryption.

**What is guaranteed.** Nothing from a peer is used or unpickled unless the peer knows the job's secret and the
frame's tag verifies. A frame tampered with, reordered, dropped, replayed within a connection, moved to the other
direction, or replayed from an earlier connection (whose keys came from other nonces) fails its check; the
connection is then closed. Before authentication, a listener reads at most the 37-byte client hello and 32-byte
proof, under a time limit (``handshake(timeout_s=...)``). Not provided: confidentiality unless ``encrypt`` is on (then
what stays in clear is each frame's length and type byte, and the handshake's nonces), and protection of a job
whose secret leaked.
"""

from __future__ import annotations

import functools
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
MAGIC = b"SHVD\x03"  # \x03: data frames tagged with GMAC (\x02: Poly1305)
#: The hello of an end that encrypts its frames (``encrypt=True``)
ENCRYPTED_MAGIC = b"SHVD\x83"
NONCE_SIZE = 32
PROOF_SIZE = hashlib.sha256().digest_size
TAG_SIZE = 16
_LENGTH = struct.Struct("!Q")
_COUNTER = struct.Struct("!Q")
_NONCE_PAD = bytes(4)  # a GCM nonce is 12 bytes here: 4 zero bytes, then the 8-byte frame counter
HEADER_SIZE = _LENGTH.size + TAG_SIZE
#: Bytes a listener reads from a peer before it is authenticated (client hello, then its proof).
PRE_AUTH_BYTES = len(MAGIC) + NONCE_SIZE + PROOF_SIZE
MAX_OBJECT_FRAME = 1 << 30
HANDSHAKE_TIMEOUT_S = 30.0


def make_secret() -> bytes:
    """A fresh random per-job secret."""
    return secrets.token_bytes(32)


def secret_from_env(environ: dict[str, str] | None = None) -> bytes:
    """The job's secret from ``SPARK_HVD_SECRET`` (hex), as set by the launcher or the Spark runner."""
    value = (environ if environ is not None else os.environ).get(SECRET_ENV)
    if not value:
        raise AuthenticationError(f"{SECRET_ENV} is not set: every rank needs the job's secret to join.")
    return bytes.fromhex(value)


def check_encryption(rank: int, modes: list[bool]) -> None:
    """Raise ``AuthenticationError`` on every rank when the ranks' encryption settings (``modes``, by rank, as
    published at the rendezvous) differ, before any connection is made: the message names this rank, the ranks that
    see it otherwise, and the ranks at odds with the rest (the fewer; on a tie, those that differ from rank 0)."""
    on = [r for r, mode in enumerate(modes) if mode]
    off = [r for r, mode in enumerate(modes) if not mode]
    if not on or not off:
        return
    odd = on if len(on) < len(off) or (len(on) == len(off) and not modes[0]) else off
    others = off if modes[rank] else on
    raise AuthenticationError(
        f"rank {rank}: encryption in transit is {'on' if modes[rank] else 'off'} here but "
        f"{'off' if modes[rank] else 'on'} on rank(s) {others}; rank(s) {odd} are at odds with the rest: every "
        "rank of a job must set SPARK_HVD_ENCRYPT alike (run(encrypt=...), spark-hvd-run --encrypt)")


def sign(secret: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenation of ``parts`` (no copy of large buffers)."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


@functools.cache
def _aead() -> Any:
    # imported on first use: ``import spark_hvd`` stays light
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM


@functools.cache
def _invalid_tag() -> type[Exception]:
    from cryptography.exceptions import InvalidTag

    return InvalidTag


def _mode(encrypt: bool) -> str:
    return "encrypts its frames" if encrypt else "does not encrypt its frames"


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; a closed connection raises ``ConnectionError``."""
    while len(view):
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        view = view[n:]


class _Direction:
    """The keys and frame counter of one direction of a connection (``encrypt``: every frame is sealed)."""

    __slots__ = ("key", "counter", "_data", "encrypt", "_into")

    def __init__(self, key: bytes, encrypt: bool = False) -> None:
        self.key = key
        self.counter = 0
        self.encrypt = encrypt
        self._data: Any = None  # the frames' AEAD, built on first use
        self._into = False  # it has encrypt_into / decrypt_into (cryptography >= 45)

    def _cipher(self) -> Any:
        if self._data is None:
            self._data = _aead()(self.data_key())
            self._into = hasattr(self._data, "decrypt_into") and hasattr(self._data, "encrypt_into")
        return self._data

    def tag(self, length: int, parts: tuple[bytes | memoryview, ...], fast: bool) -> bytes:
        """The tag of the next frame on this direction (advances the counter)."""
        if fast and (len(parts) > 2 or (len(parts) == 2 and memoryview(parts[0]).nbytes != 1)):
            # the receiver splits a data frame the same way: one payload, after at most one type byte
            raise ValueError("a data frame is one payload, optionally after one type byte")
        if fast:
            return self.data_tag(self.reserve(), length, b"".join(parts[:-1]), parts[-1] if parts else b"")
        counter = _COUNTER.pack(self.counter)
        self.counter += 1
        return sign(self.key, counter, _LENGTH.pack(length), *parts)[:TAG_SIZE]

    def reserve(self) -> int:
        """Take the next frame counter for a data frame whose tag ``data_tag`` computes later (perhaps on
        another thread: ``data_tag`` only reads this object once ``reserve`` has run)."""
        self._cipher()
        counter = self.counter
        self.counter += 1
        return counter

    def data_tag(self, counter: int, length: int, kind: bytes, payload: bytes | memoryview) -> bytes:
        """The GMAC tag of the data frame ``kind | payload`` of ``length`` bytes numbered ``counter`` (from
        ``reserve``)."""
        return self._data.encrypt(_NONCE_PAD + _COUNTER.pack(counter), _LENGTH.pack(length) + kind,
                                  payload)[-TAG_SIZE:]

    def data_key(self) -> bytes:
        """The AES-256-GCM key of this direction's data frames (the compiled ring loop tags with it too); with
        ``encrypt``, of every frame (another label: a frame sealed in one mode never opens in the other)."""
        return sign(self.key, b"spark_hvd encrypted frames" if self.encrypt else b"spark_hvd data frames")

    @property
    def gmac(self) -> Any:
        """The AEAD's ``encrypt``: thread-safe, it hashes under a copy of the key's context and without the GIL, so
        another thread may compute a tag while this one sends or receives (or the compiled ring loop call it)."""
        return self._cipher().encrypt

    # -- encrypted frames (``encrypt``) ---------------------------------------------------------------------------
    def seal(self, counter: int, length: int, clear: bytes, body: bytes | memoryview) -> bytes:
        """Ciphertext and tag (``len(body) + TAG_SIZE`` bytes) of the frame numbered ``counter`` (from ``reserve``)
        of ``length`` bytes whose clear prefix is ``clear`` and whose encrypted rest is ``body``."""
        return self._cipher().encrypt(_NONCE_PAD + _COUNTER.pack(counter), body, _LENGTH.pack(length) + clear)

    def seal_to(self, counter: int, length: int, clear: bytes, body: bytes | memoryview, out: memoryview) -> None:
        """``seal`` into ``out`` (``len(body) + TAG_SIZE`` bytes) instead of a new object."""
        self.seal_into(_NONCE_PAD + _COUNTER.pack(counter), _LENGTH.pack(length) + clear, body, out)

    def open(self, counter: int, length: int, clear: bytes, body: memoryview, tag: bytes) -> bool:
        """Decrypt the received frame numbered ``counter`` (``body``: its ciphertext, replaced by its plaintext)
        if ``tag`` checks out (True); else False, and ``body`` must not be used."""
        sealed = bytearray(body.nbytes + TAG_SIZE)
        sealed[:body.nbytes] = body
        sealed[body.nbytes:] = tag
        return self.open_into(_NONCE_PAD + _COUNTER.pack(counter), _LENGTH.pack(length) + clear, sealed, body)

    def seal_into(self, nonce: bytes, aad: bytes, data: memoryview, out: memoryview) -> None:
        """``out`` (``len(data) + TAG_SIZE`` bytes) = AES-256-GCM(``data``) | tag: the compiled ring loop's."""
        cipher = self._cipher()
        if self._into:
            cipher.encrypt_into(nonce, data, aad, out)
        else:
            out[:] = cipher.encrypt(nonce, data, aad)

    def open_into(self, nonce: bytes, aad: bytes, sealed: bytes | bytearray | memoryview, out: memoryview) -> bool:
        """``out`` = the plaintext of ``sealed`` (ciphertext | tag) if its tag checks out (True); else False, and
        ``out`` must not be used (the compiled ring loop's too)."""
        cipher = self._cipher()
        try:
            if self._into:
                cipher.decrypt_into(nonce, sealed, aad, out)
            else:
                out[:] = cipher.decrypt(nonce, bytes(sealed), aad)
        except _invalid_tag():
            return False
        return True


class FramedSocket:
    """A connected socket that proves the job's secret once (handshake) and authenticates every frame.

    ``peer`` is a human label (``"rank 3"``, ``"driver"``) used in error messages. The handshake runs explicitly
    (``handshake("client" | "server")``) or lazily: the first send makes this end the client, the first receive
    the server. ``encrypt``: every frame is encrypted too (both ends must say so, see the module docstring).
    """

    #: A frame's first payload byte is its type, left in clear when frames are encrypted (``PeerSocket``)
    TYPED = False

    def __init__(self, sock: socket.socket, secret: bytes, peer: str = "peer", encrypt: bool = False) -> None:
        self.sock = sock
        self.secret = secret
        self.peer = peer
        self.encrypt = encrypt
        self._out: _Direction | None = None
        self._in: _Direction | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- handshake -------------------------------------------------------------------------------------------
    @property
    def authenticated(self) -> bool:
        return self._out is not None

    def handshake(self, role: str, timeout_s: float | None = HANDSHAKE_TIMEOUT_S) -> None:
        """Prove the secret to the peer and check its proof (``role``: "client" dials, "server" accepted).

        ``timeout_s`` bounds the whole exchange (None: the socket's own timeout). Raises
        ``AuthenticationError`` if the peer does not know the secret, ``PeerFailureError`` if it goes away or
        is too slow.
        """
        if role not in ("client", "server"):
            raise ValueError(f"handshake role must be 'client' or 'server', not {role!r}")
        if self._out is not None:
            return
        saved = self.sock.gettimeout()
        try:
            if timeout_s is not None:
                self.sock.settimeout(timeout_s)
            mine = secrets.token_bytes(NONCE_SIZE)
            magic = ENCRYPTED_MAGIC if self.encrypt else MAGIC
            if role == "client":
                self.sock.sendall(magic + mine)
                reply = self._read_fixed(len(MAGIC) + NONCE_SIZE + PROOF_SIZE)
                theirs = self._check_magic(reply)[:NONCE_SIZE]
                nc, ns = mine, theirs
                self._check_proof(b"server", nc, ns, reply[len(MAGIC) + NONCE_SIZE:])
                self.sock.sendall(sign(self.secret, self._label(b"client"), nc, ns))
            else:
                hello = self._read_fixed(len(MAGIC) + NONCE_SIZE)
                if hello[:len(MAGIC)] == (MAGIC if self.encrypt else ENCRYPTED_MAGIC):
                    # the other mode: answer with this end's (and no proof), so that the client can say so too
                    self.sock.sendall(magic + mine + bytes(PROOF_SIZE))
                nc, ns = self._check_magic(hello), mine
                self.sock.sendall(magic + ns + sign(self.secret, self._label(b"server"), nc, ns))
                self._check_proof(b"client", nc, ns, self._read_fixed(PROOF_SIZE))
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"handshake with {self.peer} failed: {exc}") from exc
        finally:
            try:
                self.sock.settimeout(saved)
            except OSError:
                pass
        c2s = _Direction(sign(self.secret, b"c2s", nc, ns), self.encrypt)
        s2c = _Direction(sign(self.secret, b"s2c", nc, ns), self.encrypt)
        self._out, self._in = (c2s, s2c) if role == "client" else (s2c, c2s)

    def _label(self, role: bytes) -> bytes:
        """A proof's label: the role, and whether this end encrypts (a proof made in one mode fails in the other)."""
        return role + b" encrypted" if self.encrypt else role

    def _read_fixed(self, n: int) -> bytes:
        buf = bytearray(n)
        recv_exactly(self.sock, memoryview(buf))
        return bytes(buf)

    def _check_magic(self, message: bytes) -> bytes:
        magic = message[:len(MAGIC)]
        if magic == (MAGIC if self.encrypt else ENCRYPTED_MAGIC):
            mine = "does" if self.encrypt else "does not"
            message = (f"{self.peer} {_mode(not self.encrypt)} and this process {mine} (SPARK_HVD_ENCRYPT, "
                       "run(encrypt=...), spark-hvd-run --encrypt): every rank of a job and its driver must agree; "
                       "connection dropped")
            logger.warning("%s", message)
            raise AuthenticationError(message)
        if magic != (ENCRYPTED_MAGIC if self.encrypt else MAGIC):
            raise AuthenticationError(f"{self.peer} does not speak the spark_hvd protocol (bad handshake)")
        return message[len(MAGIC):]

    def _check_proof(self, label: bytes, nc: bytes, ns: bytes, proof: bytes) -> None:
        if not hmac.compare_digest(sign(self.secret, self._label(label), nc, ns), proof):
            logger.warning("%s failed the handshake: it does not know the job's secret", self.peer)
            raise AuthenticationError(f"{self.peer} failed the handshake (wrong job secret, or a replayed "
                                      "connection); connection dropped")

    def _sending(self) -> _Direction:
        if self._out is None:
            self.handshake("client")
        assert self._out is not None
        return self._out

    def _receiving(self) -> _Direction:
        if self._in is None:
            self.handshake("server")
        assert self._in is not None
        return self._in

    # -- frames ----------------------------------------------------------------------------------------------
    def send_bytes(self, *parts: bytes | memoryview, fast: bool = False) -> None:
        """Send one frame made of ``parts`` (scatter-gather, no concatenation).

        ``fast``: a data frame (GMAC tag), for payloads the receiver never unpickles: ``parts`` is one payload,
        optionally after one type byte, split the same way by the receiver (its tag depends on the split).
        """
        try:
            direction = self._sending()
            length = sum(memoryview(p).nbytes for p in parts)
            if self.encrypt:
                clear, body = self._split(parts)
                sealed = memoryview(direction.seal(direction.reserve(), length, clear, body))
                header = _LENGTH.pack(length) + sealed[-TAG_SIZE:]
                parts = (clear, sealed[:-TAG_SIZE]) if clear else (sealed[:-TAG_SIZE],)
            else:
                header = _LENGTH.pack(length) + direction.tag(length, parts, fast)
            if length <= 65536:
                self.sock.sendall(b"".join([header, *parts]))
                return
            self.sock.sendall(header)
            for part in parts:
                self.sock.sendall(part)
        except OSError as exc:
            raise PeerFailureError(f"sending to {self.peer} failed: {exc}") from exc

    def _split(self, parts: tuple[bytes | memoryview, ...]) -> tuple[bytes, bytes | memoryview]:
        """(clear prefix, the rest) of an encrypted frame made of ``parts``: its type byte on a ``TYPED`` socket."""
        if self.TYPED:
            if not parts or memoryview(parts[0]).nbytes != 1:
                raise ValueError("a typed frame starts with its one type byte")
            clear, parts = bytes(parts[0]), parts[1:]
        else:
            clear = b""
        return clear, parts[0] if len(parts) == 1 else b"".join(parts)

    def recv_header(self) -> tuple[int, bytes]:
        """The next frame's (length, tag); the payload is not yet trusted."""
        self._receiving()
        header = bytearray(HEADER_SIZE)
        try:
            recv_exactly(self.sock, memoryview(header))
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        (length,) = _LENGTH.unpack_from(header)
        return length, bytes(header[_LENGTH.size:])

    def verify(self, tag: bytes, length: int, *parts: bytes | memoryview, fast: bool = False) -> None:
        """Check a received frame's ``tag``; ``AuthenticationError`` (logged) when it fails. With ``encrypt``,
        the frame is decrypted: its last part (writable: a ``bytearray`` or a view of one) is replaced by its
        plaintext (undefined when the tag fails, which raises); a ``TYPED`` socket's type byte is the part before
        it."""
        assert self._in is not None
        if not self.encrypt:
            self.check_tag(self._in.tag(length, parts, fast), tag)
            return
        clear = b"".join(parts[:-1])
        if len(parts) > (2 if self.TYPED else 1) or len(clear) != (1 if self.TYPED else 0):
            raise ValueError("an encrypted frame is received as its type byte (typed sockets) and one payload")
        if not self._in.open(self._in.reserve(), length, clear, memoryview(parts[-1]).cast("B"), tag):
            self.reject()

    def check_tag(self, expected: bytes, tag: bytes) -> None:
        """``AuthenticationError`` (logged) unless a received ``tag`` equals the one computed here."""
        if not hmac.compare_digest(expected, tag):
            self.reject()

    def reject(self) -> None:
        """A received frame failed its check: ``AuthenticationError`` (logged)."""
        logger.warning("dropped a frame from %s that failed its authentication check", self.peer)
        raise AuthenticationError(f"a frame from {self.peer} failed the HMAC check; connection dropped")

    def recv_bytes(self, max_size: int = MAX_OBJECT_FRAME) -> bytes:
        """Receive one control frame and return its payload once its tag checked out."""
        length, tag = self.recv_header()
        if length > max_size:
            raise AuthenticationError(f"a frame from {self.peer} claims {length} bytes (> {max_size}); dropped")
        payload = bytearray(length)
        try:
            recv_exactly(self.sock, memoryview(payload))
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        self.verify(tag, length, payload)
        return bytes(payload)

    def recv_into(self, buffer: memoryview, fast: bool = False) -> None:
        """Receive one frame straight into ``buffer``, whose size must equal the frame's length."""
        buffer = memoryview(buffer).cast("B")
        length, tag = self.recv_header()
        if length != buffer.nbytes:
            raise AuthenticationError(
                f"a frame from {self.peer} has {length} bytes where {buffer.nbytes} were expected; dropped")
        try:
            recv_exactly(self.sock, buffer)
        except (OSError, ConnectionError) as exc:
            raise PeerFailureError(f"receiving from {self.peer} failed: {exc}") from exc
        self.verify(tag, length, buffer, fast=fast)

    def send_object(self, obj: Any) -> None:
        """Pickle ``obj`` and send it as one authenticated control frame."""
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv_object(self, max_size: int = MAX_OBJECT_FRAME) -> Any:
        """Receive one control frame, check its tag, and only then unpickle it."""
        return pickle.loads(self.recv_bytes(max_size))
