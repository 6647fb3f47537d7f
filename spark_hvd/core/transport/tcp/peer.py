"""One connection of the TCP mesh: a ``PeerSocket`` to one peer rank, its frame types and the abort protocol.

Every connection first proves the job's secret (``FramedSocket.handshake``: fresh nonces from both ends,
per-connection keys), then carries ``FramedSocket`` frames whose payload starts with one type byte: ``DATA`` frames
carry collective payloads, are authenticated with GMAC (AES-GCM's tag, cheap next to the copy) and received straight
into the destination buffer, and are never unpickled; ``ABORT``, ``HELLO`` and ``BYE`` frames are HMAC'd control
frames. With ``encrypt`` every frame is AES-256-GCM-encrypted but for its type byte (``FramedSocket.TYPED``), which
``probe`` peeks at to find an ABORT or a BYE without reading a frame. An ABORT tells a peer that a rank failed, so
that every rank of the job fails fast and names the same culprit instead of waiting for its own timeout. A BYE, the
last frame of a healthy rank that closes its backend, tells a peer that the connection's end is no death: a rank that
finished its part of the last collective may leave while others still wait on shared memory, and their liveness
checks must not blame it (a receive it still owed fails, naming it).

Beside the connection: ``PeerWatcher`` (many peers checked for EOF / ABORT in one ``poll``) and ``SendWorker`` (a
thread that sends frames so a step's send overlaps its receive). The ring's exchange loop is in ``loop``, the mesh
setup in ``mesh``.
"""

from __future__ import annotations

import fcntl
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Sequence

from spark_hvd.core.errors import AuthenticationError, CollectiveTimeoutError, PeerFailureError, SparkHvdError
from spark_hvd.core.transport.wire import _LENGTH, HEADER_SIZE, FramedSocket, recv_exactly

DATA = b"\x00"
ABORT = b"\x01"
HELLO = b"\x02"
BYE = b"\x03"
_ABORT_HEAD = struct.Struct("!q")
MAX_CONTROL_FRAME = 64 * 1024
#: A peer that closed with up to this many bytes unread is checked for a final BYE without reading them
MAX_PEEK_BYTES = 64 * 1024 * 1024
#: Payloads up to this size are sent from the calling thread (they fit the socket buffers: no deadlock).
INLINE_SEND_BYTES = 32 * 1024
#: Congestion controls under which two ranks on one connection do not hold each other back (nor clamp the window):
#: loss-based windows grow until the queue holds them, so both directions stay at the link's rate anyway. Under
#: cubic the rule gained no time and cost 0.7-2.4 ms of CPU per 16-64 MiB allreduce at np=2 (issue 23); reno has
#: the same loss-based window (not measured). Any other (BBR, unknown ones) keeps the rule.
LOSS_BASED_CONGESTION = frozenset({"cubic", "reno"})
#: The small-message path (``RingExchange(spin=True)``: a two-rank exchange of at most ``SPIN_MAX_BYTES``) polls
#: again at once for up to ``SPIN_S`` before it sleeps in ``poll``. The other rank's frame usually comes within
#: microseconds when both ranks have a core; a rank that slept instead paid the wake-up and came back with its
#: caches cold, late for the next call, so the other rank slept in turn. Measured (np=2, 4 KiB, SCHED_FIFO ranks on
#: the loaded 2-core machine): the bare allreduce 0.041 -> 0.033 ms, a new name through ``hvd.allreduce_`` 0.067-0.078
#: -> 0.047-0.051 ms. A spin that ends without the frame (the other rank was not running) makes this socket sleep
#: at once for the next 1, 3, 7, ... 255 waits (``PeerSocket.spin_deadline``), so a loaded machine loses little.
SPIN_S = 50e-6
SPIN_MAX_BYTES = 64 * 1024
_SPIN_MAX_MISSES = 8
_POLL_BAD = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


class PeerAbort(PeerFailureError):
    """A peer reported that a rank of the job failed (``rank`` is the failed rank, ``reporter`` who said so)."""

    def __init__(self, message: str, rank: int | None, operation: str | None, reporter: int) -> None:
        super().__init__(message, rank, operation)
        self.reporter = reporter


class ProtocolError(SparkHvdError):
    """A peer sent a frame of another size than this rank expected: the ranks called different collectives."""


class PeerSocket(FramedSocket):
    """A ``FramedSocket`` to one peer rank, with typed frames, a send lock and liveness probing.

    ``recv_broken`` / ``send_broken``: a direction whose stream may be out of frame alignment after an error.
    """

    TYPED = True  # the type byte stays in clear when frames are encrypted: ``probe`` peeks at it

    def __init__(self, sock: socket.socket, secret: bytes, rank: int, timeout_s: float, encrypt: bool = False) -> None:
        super().__init__(sock, secret, f"rank {rank}", encrypt)
        self.rank = rank
        #: where the peer runs (" on host NAME (ADDRESS)"), for error messages; set once the mesh is up
        self.where = ""
        self.timeout_s = timeout_s
        self.send_lock = threading.Lock()
        self.recv_broken = False
        self.send_broken = False
        #: the peer closed its backend on purpose (a BYE frame arrived): its EOF is no failure
        self.said_bye = False
        self._bye_checked = -1  # the stream length at which _ends_with_bye last found a BYE at its end
        #: encrypted frames: the ciphertext (and tag) of the frame being sent / received, kept between exchanges
        self._stages: dict[str, bytearray] = {}
        self._spin_misses = 0  # spins in a row that ended without a frame (``spin_deadline``)
        self._spin_skip = 0  # waits still to sleep through at once after a spin in vain
        self._couples: bool | None = None  # ``couples_directions``, read once
        sock.settimeout(timeout_s)

    def couples_directions(self) -> bool:
        """Whether a two-rank exchange on this connection holds each direction to ``RUN_AHEAD_BYTES`` ahead of the
        other: unless its congestion control is loss-based (``LOSS_BASED_CONGESTION``); a socket without one (a
        Unix socket pair) does."""
        if self._couples is None:
            try:
                name = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            except OSError:
                name = b""
            self._couples = name.split(b"\0", 1)[0].decode(errors="replace") not in LOSS_BASED_CONGESTION
        return self._couples

    def spin_deadline(self, now: float) -> float:
        """How long a wait for this peer's next frame on the small-message path polls without sleeping: until
        ``now + SPIN_S``, or 0.0 (sleep at once) while the waits after a spin in vain are being skipped."""
        if self._spin_skip:
            self._spin_skip -= 1
            return 0.0
        return now + SPIN_S

    def spin_ended(self, arrived: bool) -> None:
        """A spin ended: with the frame (spin again next time), or in vain (skip the next 2**k - 1 waits)."""
        if arrived:
            self._spin_misses = 0
        else:
            self._spin_misses = min(self._spin_misses + 1, _SPIN_MAX_MISSES)
            self._spin_skip = (1 << self._spin_misses) - 1

    # -- receiving -------------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, operation: str) -> PeerFailureError:
        if self.said_bye:
            return self._left(operation)
        if isinstance(exc, TimeoutError | socket.timeout):
            return CollectiveTimeoutError(
                f"{operation}: rank {self.rank}{self.where} sent nothing for {self.timeout_s:.0f}s "
                "(SPARK_HVD_TIMEOUT); it is stuck, unreachable, or waiting for another rank that is",
                rank=self.rank, operation=operation)
        return PeerFailureError(f"{operation}: the connection to rank {self.rank}{self.where} failed ({exc}); "
                                f"that process probably died", rank=self.rank, operation=operation)

    def _read(self, view: memoryview, operation: str) -> None:
        try:
            recv_exactly(self.sock, view)
        except (OSError, ConnectionError) as exc:
            self.recv_broken = True
            raise self._fail(exc, operation) from exc

    def _verify(self, tag: bytes, length: int, *parts: memoryview | bytes, fast: bool = False) -> None:
        try:
            self.verify(tag, length, *parts, fast=fast)
        except AuthenticationError:
            self.recv_broken = True
            raise

    def stage(self, side: str, nbytes: int) -> memoryview:
        """A staging buffer of ``nbytes`` for one encrypted frame at a time on ``side`` ("send" / "recv"), reused
        from one frame and exchange to the next (grown when needed)."""
        buf = self._stages.get(side)
        if buf is None or len(buf) < nbytes:
            buf = self._stages[side] = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _rejected(self) -> None:
        """A received frame failed its check (its decryption): ``AuthenticationError``, the stream marked broken."""
        self.recv_broken = True
        self.reject()

    def _check(self, expected: bytes, tag: bytes) -> None:
        try:
            self.check_tag(expected, tag)
        except AuthenticationError:
            self.recv_broken = True
            raise

    def _header(self, operation: str) -> tuple[int, bytes, bytes]:
        head = bytearray(HEADER_SIZE + 1)
        self._read(memoryview(head), operation)
        (length,) = _LENGTH.unpack_from(head)
        if length < 1:
            self.recv_broken = True
            raise AuthenticationError(f"an empty frame from rank {self.rank}; connection dropped")
        return length, bytes(head[_LENGTH.size:HEADER_SIZE]), bytes(head[HEADER_SIZE:])

    def _control(self, length: int, digest: bytes, kind: bytes, operation: str) -> bytes:
        if length - 1 > MAX_CONTROL_FRAME:
            self.recv_broken = True
            raise AuthenticationError(f"a control frame from rank {self.rank} claims {length} bytes; dropped")
        payload = bytearray(length - 1)
        self._read(memoryview(payload), operation)
        self._verify(digest, length, kind, payload, fast=kind == DATA)
        if kind == BYE:
            self.said_bye = True
        if kind == ABORT:
            (culprit,) = _ABORT_HEAD.unpack_from(payload)
            reason = bytes(payload[_ABORT_HEAD.size:]).decode("utf-8", "replace")
            who = None if culprit < 0 else culprit
            raise PeerAbort(f"{operation}: rank {who if who is not None else '?'} failed (reported by rank "
                            f"{self.rank}): {reason}", who, operation, self.rank)
        return bytes(payload)

    def recv_data_into(self, buffer: memoryview, operation: str) -> None:
        """Receive one DATA frame straight into ``buffer`` (an ABORT frame raises ``PeerAbort``)."""
        buffer = memoryview(buffer).cast("B")
        length, digest, kind = self._header(operation)
        if kind != DATA:
            self._control(length, digest, kind, operation)
            raise self.unexpected(kind, operation)
        if length - 1 != buffer.nbytes:
            self.recv_broken = True
            raise ProtocolError(
                f"{operation}: rank {self.rank} sent {length - 1} bytes where {buffer.nbytes} were expected; the "
                "ranks called collectives in different orders or with different shapes")
        self._read(buffer, operation)
        self._verify(digest, length, kind, buffer, fast=True)

    def _left(self, operation: str) -> PeerFailureError:
        self.recv_broken = True
        return PeerFailureError(
            f"{operation}: rank {self.rank}{self.where} closed its connection (it shut down or finished) while this "
            "rank still expected its data; the ranks ran different numbers of collectives", rank=self.rank,
            operation=operation)

    def unexpected(self, kind: bytes, operation: str) -> SparkHvdError:
        """The error for a control frame of type ``kind`` where a DATA frame was expected."""
        if kind == BYE:
            return self._left(operation)
        return ProtocolError(f"{operation}: unexpected control frame from rank {self.rank}")

    def recv_message(self, operation: str, kind_expected: bytes = DATA) -> bytes:
        """Receive one small frame of type ``kind_expected`` and return its payload."""
        length, digest, kind = self._header(operation)
        payload = self._control(length, digest, kind, operation)
        if kind != kind_expected:
            raise ProtocolError(f"{operation}: unexpected frame type {kind!r} from rank {self.rank}")
        return payload

    # -- sending ---------------------------------------------------------------------------------------------
    def data_header(self, payload: memoryview) -> bytes:
        """Header and type byte of the next DATA frame carrying ``payload`` (advances the send counter); frames
        that are not encrypted only (an encrypted frame sends its ciphertext, not ``payload``)."""
        if self.encrypt:
            raise ValueError("data_header: an encrypted frame's header comes with its ciphertext (send_data)")
        direction = self._sending()
        length = payload.nbytes + 1
        return _LENGTH.pack(length) + direction.tag(length, (DATA, payload), True) + DATA

    def send_data(self, parts: Sequence[memoryview | bytes], operation: str, kind: bytes = DATA) -> None:
        """Send one frame of type ``kind`` made of ``parts``."""
        with self.send_lock:
            try:
                self.send_bytes(kind, *parts, fast=kind == DATA)
            except PeerFailureError as exc:
                self.send_broken = True
                cause = exc.__cause__ or exc
                raise self._fail(cause, operation) from exc

    def send_abort(self, culprit: int | None, reason: str) -> None:
        """Best effort: tell the peer that ``culprit`` failed (skipped if a send to it is under way)."""
        if self.send_broken or not self.send_lock.acquire(blocking=False):
            return
        try:
            self.sock.settimeout(0.5)
            self.send_bytes(ABORT, _ABORT_HEAD.pack(-1 if culprit is None else culprit), reason.encode()[:4000])
        except (PeerFailureError, OSError):
            self.send_broken = True
        finally:
            try:
                self.sock.settimeout(self.timeout_s)
            except OSError:
                pass
            self.send_lock.release()

    def send_bye(self) -> None:
        """Best effort: tell the peer this rank closes its backend in good health (see the module docstring)."""
        if self.send_broken or not self.send_lock.acquire(blocking=False):
            return
        try:
            self.sock.settimeout(0.5)
            self.send_bytes(BYE)
        except (PeerFailureError, OSError):
            self.send_broken = True
        finally:
            self.send_lock.release()

    # -- liveness --------------------------------------------------------------------------------------------
    def _peek(self) -> bytes | None:
        """The next frame's header + type byte if fully arrived, b"" at EOF, None if nothing (complete) is there."""
        # a socket in timeout mode polls before recv (ignoring MSG_DONTWAIT): make it non-blocking meanwhile
        timeout = self.sock.gettimeout()
        try:
            self.sock.settimeout(0.0)
            head = self.sock.recv(HEADER_SIZE + 1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""
        finally:
            try:
                self.sock.settimeout(timeout)
            except OSError:
                pass
        if head and len(head) < HEADER_SIZE + 1:
            return None
        return head

    def probe(self, operation: str, closed: bool = False) -> None:
        """Raise ``PeerFailureError`` if the peer sent an ABORT frame or closed the connection (non-blocking).

        A pending DATA frame (the peer already in the next collective) is left in place, unless ``closed`` says
        the peer shut the connection: then pending frames are read in search of an ABORT naming the culprit.
        """
        if self.recv_broken or self.said_bye:
            return
        head = self._peek()
        if head is None and not closed:
            return
        if head and head[HEADER_SIZE:] in (ABORT, BYE):
            self._control(*self._header(operation), operation)  # raises PeerAbort, or notes the BYE
            if self.said_bye:
                return
        if head and closed:
            if self._ends_with_bye():  # it left in good health after sending frames this rank is yet to read
                return
            reported = self.find_abort(operation)
            if reported is not None:
                raise reported
            if self.said_bye:
                return
        if not head or closed:
            self.recv_broken = True
            raise self._fail(ConnectionError("connection closed by peer"), operation)

    def _ends_with_bye(self) -> bool:
        """Does what is left of the stream (the peer closed it) end with a BYE frame? Peeked, nothing consumed.

        Frames are walked by their (not yet verified) lengths only to decide this; each is verified when read.
        """
        try:
            available = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return False
        if self._bye_checked == available:
            return True
        if not 0 < available <= MAX_PEEK_BYTES:
            return False
        timeout = self.sock.gettimeout()
        try:
            self.sock.settimeout(0.0)
            data = self.sock.recv(available, socket.MSG_PEEK)
        except OSError:
            return False
        finally:
            self.sock.settimeout(timeout)
        offset, kind = 0, b""
        while offset + HEADER_SIZE + 1 <= len(data):
            (length,) = _LENGTH.unpack_from(data, offset)
            if length < 1:
                return False
            kind = data[offset + HEADER_SIZE:offset + HEADER_SIZE + 1]
            offset += HEADER_SIZE + length
        if offset != len(data) or kind != BYE:
            return False
        self._bye_checked = available
        return True

    def find_abort(self, operation: str, wait_s: float = 0.05) -> PeerAbort | None:
        """Read (and drop) pending frames looking for an ABORT; its ``PeerAbort``, or None.

        Used once a collective has failed, to name the rank a peer blamed rather than the peer that closed.
        """
        if self.recv_broken:
            return None
        deadline = time.monotonic() + wait_s
        try:
            while True:
                head = self._peek()
                if head is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                        return None
                    continue
                if not head:
                    return None
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                length, digest, kind = self._header(operation)
                if kind == DATA:
                    if length > 64 * 1024 * 1024:
                        return None
                    payload = bytearray(length - 1)
                    self._read(memoryview(payload), operation)
                    self._verify(digest, length, kind, payload, fast=True)
                else:
                    self._control(length, digest, kind, operation)
        except PeerAbort as abort:
            return abort
        except (SparkHvdError, OSError):
            self.recv_broken = True
            return None
        finally:
            try:
                self.sock.settimeout(self.timeout_s)
            except OSError:
                pass


class PeerWatcher:
    """Checks many peer sockets at once for EOF / ABORT frames (one ``poll`` system call)."""

    def __init__(self, peers: Sequence[PeerSocket]) -> None:
        self._peers = {p.fileno(): p for p in peers}
        self._poll = select.poll()
        for fd in self._peers:
            self._poll.register(fd, select.POLLIN | _POLL_BAD)

    def check(self, operation: str) -> None:
        for fd, events in self._poll.poll(0):
            peer = self._peers.get(fd)
            if peer is not None:
                peer.probe(operation, closed=bool(events & _POLL_BAD))
                if peer.said_bye:  # its end of the socket stays readable (EOF): stop polling it
                    self._poll.unregister(fd)
                    del self._peers[fd]


class SendWorker:
    """A background thread that sends frames so a ring step's send overlaps its receive."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._posted = 0
        self._finished = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="spark-hvd-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            peer, parts, operation = job
            try:
                if self._error is None:
                    peer.send_data(parts, operation)
            except BaseException as exc:  # reported to the caller by wait()
                self._error = exc
            with self._done:
                self._finished += 1
                self._done.notify_all()

    def post(self, peer: PeerSocket, parts: Sequence[memoryview | bytes], operation: str) -> None:
        """Queue one frame to ``peer``."""
        self._posted += 1
        self._jobs.put((peer, parts, operation))

    def check(self) -> None:
        """Re-raise a send error now (cheap; the caller keeps receiving otherwise)."""
        if self._error is not None:
            raise self._error

    def wait(self, timeout_s: float, operation: str) -> None:
        """Wait until every posted frame went out; re-raise a send error."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._finished < self._posted:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(f"{operation}: sending did not finish within {timeout_s:.0f}s",
                                                 operation=operation)
                self._done.wait(min(left, 1.0))
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def stop(self) -> None:
        self._jobs.put(None)
