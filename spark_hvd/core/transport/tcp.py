"""TCP transport of the ring backend: an authenticated full mesh between the ranks of a job.

Every connection first proves the job's secret (``FramedSocket.handshake``: fresh nonces from both ends,
per-connection keys), then carries ``FramedSocket`` frames whose payload starts with one type byte: ``DATA`` frames
carry collective payloads, are authenticated with GMAC (AES-GCM's tag, cheap next to the copy) and received straight
into the destination buffer, and are never unpickled; ``ABORT``, ``HELLO`` and ``BYE`` frames are HMAC'd control
frames. An ABORT tells a peer that a rank failed, so that every rank of the job fails fast and names the same
culprit instead of waiting for its own timeout. A BYE, the last frame of a healthy rank that closes its backend,
tells a peer that the connection's end is no death: a rank that finished its part of the last collective may leave
while others still wait on shared memory, and their liveness checks must not blame it (a receive it still owed
fails, naming it).

Mesh setup: each rank accepts its higher-ranked peers on a ``Listener`` (concurrent handshakes, bounded in time,
a cap on unauthenticated connections, accept errors survived), so one silent client cannot stall the setup. The
first frame says the job id and the connecting rank; a connection that fails the handshake, names another job or
an unexpected rank is dropped and logged.

Over 400 lines on purpose: the mesh setup, the framed peer connection and the pipelined ring exchange
(``RingExchange``) share the frame types and the abort protocol.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import itertools
import logging
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.core.errors import AuthenticationError, CollectiveTimeoutError, PeerFailureError, SparkHvdError
from spark_hvd.core.transport.listener import HANDSHAKE_TIMEOUT_S, Listener
from spark_hvd.core.transport.mac_pool import MacJob, MacPool
from spark_hvd.core.transport.wire import _LENGTH, HEADER_SIZE, TAG_SIZE, FramedSocket, recv_exactly

logger = logging.getLogger(__name__)

DATA = b"\x00"
ABORT = b"\x01"
HELLO = b"\x02"
BYE = b"\x03"
_ABORT_HEAD = struct.Struct("!q")
MAX_CONTROL_FRAME = 64 * 1024
#: A peer that closed with up to this many bytes unread is checked for a final BYE without reading them
MAX_PEEK_BYTES = 64 * 1024 * 1024
#: Large payloads go out in frames of at most this many bytes (bounded sendall time, hashing overlaps sending).
#: With whole frames read per wake-up a frame's fixed cost (tag call, header, hand-over, reduce call, poll, two
#: system calls) is most of the Python left per byte (issue 23's CPU per byte). A ring chunk still goes in at
#: least ``SUB_CHUNKS`` frames, so only chunks above 4 * 2 MiB get frames above 2 MiB (at np=2, arrays above
#: 16 MiB). np=2 across two simulated hosts at 2 Gbit/s, CPU per allreduce per rank at 16 / 64 MiB, 10
#: alternated rounds at load ~20 (session 5): 1 MiB 11.6 / 45.2 ms, 2 MiB 10.9 / 42.7, 4 MiB 10.7 / 41.2 (gloo
#: 12.1 / 41.8), wall time level; session 6, interleaved in one invocation at load 7-10: 64 MiB bare ring 45.2 ->
#: 43.8 ms, api 46.2 -> 41.2 ms (gloo 43.9).
FRAME_BYTES = 4 * 1024 * 1024
#: Mesh sockets ask for a send buffer of this size (the kernel doubles it), where ``net.core.wmem_max`` lets it be
#: more than the send buffer's autotuning reaches (``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default). A
#: link-bound sender wakes for POLLOUT each time a third of its buffer drained: at 2 Gbit/s with autotuning
#: (4 MiB) ~39 wake-ups per 64 MiB allreduce at np=2, with 8 MiB ~12 (the loop's iterations 66-72 -> ~52). Where
#: wmem_max is lower (Linux's default is 208 KiB), setting it would cap the buffer below autotuning's: left alone.
SEND_BUFFER_BYTES = 4 * 1024 * 1024
#: The ring splits each step's chunk into ``SUB_CHUNKS`` sub-chunks (frames), each of at least this size (fewer,
#: larger frames for small chunks: a frame's fixed cost, tag, system calls, Python, is ~20-30 us) and at most the
#: backend's frame size, so a ring step still pipelines over at least 4 frames.
SUB_CHUNK_MIN_BYTES = 256 * 1024
SUB_CHUNKS = 4
#: Payloads up to this size are sent from the calling thread (they fit the socket buffers: no deadlock).
INLINE_SEND_BYTES = 32 * 1024
#: ``RingExchange`` asks the kernel (SO_RCVLOWAT) to wake it only once the rest of the frame it reads has arrived,
#: up to this many bytes, capped at a quarter of the socket's receive buffer; once a large frame is complete it
#: waits for poll to say the next one is, rather than read the few bytes of it that are there. On a link-bound ring
#: the Python loop otherwise woke for every few kilobytes (issue 23: 128 KiB here took the ~900 system calls of a
#: 64 MiB allreduce at np=2 across two simulated hosts at 2 Gbit/s down to ~600; whole frames, readiness
#: tracked from poll and the next header read with each frame's tail, to ~220). Setting it above the receive buffer
#: would make the kernel clamp the TCP window to it and stall the sender.
#: Reads shorter than ``RECV_LOWAT_MIN_BYTES`` keep the default low-water mark (1 byte).
RECV_LOWAT_BYTES = FRAME_BYTES
#: The last frame of an exchange is read as it comes, in steps of this size (its copy overlaps its arrival: the
#: exchange's end is not delayed by the copy of a whole frame)
RECV_LOWAT_TAIL_BYTES = 256 * 1024
#: Two ranks on one connection: how many bytes a rank may hand the kernel beyond those it has received from its peer
#: while more are expected (``RingExchange.run``). Each direction's ACKs queue behind the other direction's data on
#: the links; when one direction's congestion window outgrows the other's (BBR sizes it from ACK aggregation), its
#: standing queue delays the other's ACKs and that direction runs at about the ratio of the two windows (0.1-0.7 of
#: a 2 Gbit/s link for tens of ms, issue 23). Sending no further ahead of receiving than this (as gloo's 1 MiB steps
#: do) lets a slowed direction slow the other too, which drains the queue: both stay at the link's rate. It bounds a
#: direction's data in flight to about this much (1 MiB: ~10 GB/s at 100 us round trip).
RUN_AHEAD_BYTES = 1024 * 1024
#: How long a held-back rank waits for its peer's data before it sends on regardless, until more of the peer's data
#: arrives (a late peer, or one that answers only after more than ``RUN_AHEAD_BYTES``, never stalls the exchange).
RUN_AHEAD_WAIT_MS = 20
#: While held back, a rank's receive low-water mark is at most this fraction (numerator, denominator) of
#: ``RUN_AHEAD_BYTES``: it wakes, reads and sends on in steps of ~768 KiB (a 64 MiB allreduce at np=2: ~90 voluntary
#: context switches per call, against ~130 with half). It must stay below the whole allowance: when both ranks are
#: held, the bytes each has sent and the other not yet read add up to at least twice the allowance (headers counted
#: on both sides alike), so one of them has at least the allowance to read and wakes; at the whole allowance it
#: would wake only once every byte its peer may send had come (no slack for a late wake-up).
RUN_AHEAD_LOWAT = (3, 4)
#: Two ranks on one connection clamp its receive window at this many times ``RUN_AHEAD_BYTES`` (TCP_WINDOW_CLAMP).
#: A held rank leaves up to the allowance unread, and the window it advertises, its free receive buffer, then
#: changes with every ACK; an ACK with a new window misses the peer's header prediction and takes TCP's slow path
#: (~870 of ~880 ACKs per 64 MiB allreduce at np=2, against ~110 of ~850 for gloo, which reads at once). Under the
#: clamp the advertised window stays at the clamp and nearly every ACK takes the fast path. While coupled a direction
#: has at most about the allowance in flight, so the clamp (2 MiB: ~16 Gbit/s at 1 ms round trip) does not bound it.
RUN_AHEAD_WINDOW = 2
#: Congestion controls under which two ranks on one connection do not hold each other back (nor clamp the window):
#: loss-based windows grow until the queue holds them, so both directions stay at the link's rate anyway. Under
#: cubic the rule gained no time and cost 0.7-2.4 ms of CPU per 16-64 MiB allreduce at np=2 (issue 23); reno has
#: the same loss-based window (not measured). Any other (BBR, unknown ones) keeps the rule.
LOSS_BASED_CONGESTION = frozenset({"cubic", "reno"})
RECV_LOWAT_MIN_BYTES = 16 * 1024
#: With a MAC pool, ``RingExchange`` tags and checks frames from this size on the pool's threads (smaller ones in
#: the calling thread: the hand-off would cost more than the tag)
MAC_POOL_MIN_BYTES = 128 * 1024
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
#: ``benchmarks/allreduce.py`` with ``BENCH_TRACE`` sets a list here, and ``RingExchange.run`` appends its per-frame
#: timeline to it: (``time.perf_counter_ns()``, event, frame, bytes) for "run" (start: frames to send, to receive),
#: "s0" / "s1" (a frame's first ``sendmsg`` / its last byte handed to the kernel, with the send socket's
#: ``tcp_state`` then), "r" (frame i's last byte received), "c" / "a" (its hand-over to the collective starts /
#: ends), "end", and "tcp" (the send socket's ``tcp_state`` at the start and the end). None (the default): nothing
#: is recorded.
TRACE: list[tuple[int, str, int, Any]] | None = None
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR
_POLL_OUT = select.POLLOUT | select.POLLHUP | select.POLLERR
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

    def __init__(self, sock: socket.socket, secret: bytes, rank: int, timeout_s: float) -> None:
        super().__init__(sock, secret, f"rank {rank}")
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
        """Header and type byte of the next DATA frame carrying ``payload`` (advances the send counter)."""
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


class RingExchange:
    """Streams DATA frames to one neighbour and from another in the calling thread (non-blocking sockets, poll).

    A ring step's receive, reduce and send overlap without thread hand-offs: while a frame is being received the
    kernel drains the frames already handed to the outgoing socket, and each frame is verified, used and (if the
    ring forwards it) queued for sending as soon as it is complete. ``run`` returns when every expected frame
    arrived and every queued frame left; nothing waits longer than ``timeout_s`` without progress.

    With a ``MacPool`` (``mac``), the tags of frames from ``mac_min_bytes`` are computed on its threads
    (``cryptography`` hashes without the GIL): a frame to send is tagged as soon as it is queued (its frame
    counter taken then, so frames still leave in counter order), and a received frame is checked while the next
    one arrives. A received frame is handed to ``on_received`` only once its tag and every earlier frame's
    checked out, in order, and ``run`` returns only when every tag did: nothing is reduced, forwarded or
    returned before its check, and a failed check raises ``AuthenticationError`` naming the peer, as inline.
    """

    def __init__(self, send_peer: PeerSocket, recv_peer: PeerSocket, operation: str,
                 mac: MacPool | None = None, mac_min_bytes: int = MAC_POOL_MIN_BYTES, spin: bool = False) -> None:
        self.send_peer, self.recv_peer, self.operation = send_peer, recv_peer, operation
        self.timeout_s = max(send_peer.timeout_s, recv_peer.timeout_s)
        self.mac, self.mac_min_bytes = mac, mac_min_bytes
        self.spin = spin  # the small-message path: poll again at once for a while before sleeping (``SPIN_S``)

    def run(self, sends: Sequence[memoryview], receives: Sequence[memoryview],
            on_received: Callable[[int], memoryview | list[memoryview] | None], window: int = 1) -> None:
        """Send ``sends``; receive frame i into ``receives[i]``, then call ``on_received(i)``, which may return a
        view (or a list of views) to send next. ``receives[i]`` is read when frame i starts, and ``on_received(0)``
        may shorten ``receives`` (a list) to expect fewer frames (``spark_hvd.core.algorithms.agreed``: what a first
        frame answered decides what follows it). Frame 0 is always checked in the calling thread, so ``on_received(0)``
        returns before a byte of frame 1 is read, with or without a pool; later frames may be read ahead of their
        checks, and the tail of frame i >= 1 is read together with frame i + 1's header (one system call) when
        frame i + 1 is expected, so only frame 0's answer may change how many frames follow. Nothing past the
        last expected frame is read.

        ``window``: how many frames may be received and not yet handed to ``on_received`` (only with a pool:
        frames waiting for their check). Receive views that alias, such as one scratch frame reused, need 1;
        with ``window`` scratch frames used in turn, ``window``.
        """
        out, recv, op, mac, mac_min = self.send_peer, self.recv_peer, self.operation, self.mac, self.mac_min_bytes
        queue_out: collections.deque[tuple[memoryview, int, MacJob | None]] = collections.deque()
        checking: collections.deque[tuple[int, bytes, MacJob | None]] = collections.deque()
        pending: list[memoryview] = []  # the frame being sent: what is left of [header, payload]
        head = bytearray(HEADER_SIZE + 1)
        head_view = memoryview(head)
        head_size = HEADER_SIZE + 1
        index, got_head, target, target_got = 0, 0, None, 0
        n_recv = len(receives)
        window = max(1, window)
        out_fd, recv_fd = out.sock.fileno(), recv.sock.fileno()
        same = out_fd == recv_fd
        can_send = can_recv = True  # try each side until it would block, then wait for poll to report it ready
        last = time.monotonic()
        lowat, lowat_cap = 1, 0
        # two ranks on one connection: hand the kernel at most ``ahead`` bytes more than have arrived from the
        # peer while more is expected (``RUN_AHEAD_BYTES``), so neither direction runs ahead of the other
        ahead = RUN_AHEAD_BYTES if same and out.couples_directions() else 0
        sent_bytes = received_bytes = 0
        released = -1  # ``received_bytes`` when a hold last ran out (``RUN_AHEAD_WAIT_MS``): no hold until more come
        spin_until: float | None = None  # this wait's spin: None undecided, 0.0 none, else until when
        poll = select.poll()
        polled: dict[int, int] = {}  # fd -> events registered with ``poll``
        mac_fd = mac.fileno() if mac is not None else -1

        def enqueue(payload: memoryview) -> None:
            """Queue a frame to send, its counter taken now (and its tag started on the pool if large)."""
            direction = out._sending()
            counter = direction.reserve()
            job = None
            if mac is not None and payload.nbytes >= mac_min:
                job = mac.submit(direction.gmac, *direction.data_tag_args(counter, payload.nbytes + 1, DATA, payload))
            queue_out.append((payload, counter, job))

        def hand_over(i: int) -> int:
            """``on_received(i)``, its answer queued to send; returns how many frames are now expected."""
            if trace is not None:
                trace.append((time.perf_counter_ns(), "c", i, 0))
            forward = on_received(i)
            if trace is not None:
                trace.append((time.perf_counter_ns(), "a", i, 0))
            if forward.__class__ is list:
                for view in forward:
                    enqueue(view)
            elif forward is not None:
                enqueue(forward)
            return len(receives)

        def want(fd: int, events: int) -> None:
            if polled.get(fd, 0) != events:
                if events:
                    poll.register(fd, events)
                    polled[fd] = events
                else:
                    poll.unregister(fd)
                    del polled[fd]

        trace = TRACE
        if trace is not None:
            trace += [(time.perf_counter_ns(), "run", len(sends), n_recv), (time.perf_counter_ns(), "tcp", 0,
                                                                             tcp_state(out.sock))]
        for payload in sends:
            enqueue(payload)
        with out.send_lock:
            try:
                out.sock.settimeout(0.0)
                recv.sock.settimeout(0.0)
                while index < n_recv or checking or pending or queue_out:
                    progressed = False
                    # -- hand over the received frames whose tags checked out, in order
                    while checking:
                        i, tag, job = checking[0]
                        if job is not None:
                            if not job.done:
                                break
                            recv._check(job.value()[-TAG_SIZE:], tag)
                        checking.popleft()
                        progressed = True
                        n_recv = hand_over(i)
                    # -- send as much as the socket takes (a short send: its buffer is full, wait for POLLOUT)
                    send_full, recv_dry, tag_wait, held = not can_send, not can_recv, False, False
                    while can_send and (pending or queue_out):
                        if not pending:
                            payload, counter, job = queue_out[0]
                            if job is None:
                                tag = out._out.data_tag(counter, payload.nbytes + 1, DATA, payload)
                            elif job.done:
                                tag = job.value()[-TAG_SIZE:]
                            else:  # its tag is still being computed on the pool
                                tag_wait = True
                                break
                            queue_out.popleft()
                            if trace is not None:
                                trace.append((time.perf_counter_ns(), "s0", counter, payload.nbytes))
                            pending = [memoryview(_LENGTH.pack(payload.nbytes + 1) + tag + DATA), payload]
                        offer = pending
                        if ahead and index < n_recv and received_bytes != released:
                            allowed = received_bytes + ahead - sent_bytes
                            if allowed <= 0:  # this rank is ``ahead`` bytes ahead of its peer: wait for its data
                                held = True
                                break
                            if allowed < sum(view.nbytes for view in pending):
                                offer = [pending[0][:allowed]] if allowed <= pending[0].nbytes else \
                                    [pending[0], pending[1][:allowed - pending[0].nbytes]]
                        try:
                            sent = out.sock.sendmsg(offer)
                        except (BlockingIOError, InterruptedError):
                            send_full = True
                            can_send = False
                            break
                        except OSError as exc:
                            out.send_broken = True
                            raise out._fail(exc, op) from exc
                        progressed = True
                        sent_bytes += sent
                        while sent and pending:
                            take = min(sent, pending[0].nbytes)
                            sent -= take
                            pending[0] = pending[0][take:]
                            if not pending[0].nbytes:
                                pending.pop(0)
                        if trace is not None and not pending:
                            trace.append((time.perf_counter_ns(), "s1", 0, tcp_state(out.sock)))
                        if pending:
                            if offer is not pending and sent == sum(view.nbytes for view in offer):
                                continue  # all that was offered was taken: the allowance decides next
                            send_full = True
                            can_send = False
                            break
                    # -- receive what has arrived
                    while index < n_recv and len(checking) < window:
                        if target is None and got_head == head_size:  # a header (perhaps read with the frame before)
                            target, target_got, got_head = self._start_frame(bytes(head), receives[index]), 0, 0
                        if target is None or target_got < target.nbytes:  # (an empty payload: nothing to read)
                            if not can_recv:
                                break
                            try:
                                if target is None:
                                    room = head_size - got_head
                                    n = recv.sock.recv_into(head_view[got_head:])
                                elif index and index + 1 < n_recv:
                                    # the rest of this frame and the next one's header in one call (not past
                                    # frame 0, whose answer may change what follows, nor past the last frame)
                                    room = target.nbytes - target_got + head_size
                                    n = recv.sock.recvmsg_into((target[target_got:], head_view))[0]
                                else:
                                    room = target.nbytes - target_got
                                    n = recv.sock.recv_into(target[target_got:])
                            except (BlockingIOError, InterruptedError):
                                recv_dry, can_recv = True, False
                                break
                            except OSError as exc:
                                recv.recv_broken = True
                                raise recv._fail(exc, op) from exc
                            if n == 0:
                                recv.recv_broken = True
                                raise recv._fail(ConnectionError("connection closed by peer"), op)
                            received_bytes += n
                            progressed = True
                            if n < room:  # a short read took all there was: wait for POLLIN
                                recv_dry, can_recv = True, False
                            if target is None:
                                got_head += n
                                if recv_dry and got_head < head_size:
                                    break
                                continue
                            target_got += n
                            if target_got < target.nbytes:
                                if recv_dry:
                                    break
                                continue
                            if target_got > target.nbytes:  # the next frame's header came too
                                got_head, target_got = target_got - target.nbytes, target.nbytes
                            if target.nbytes >= RECV_LOWAT_MIN_BYTES:
                                # a large frame is complete: let poll say when the next one is (its low-water
                                # mark) rather than read a few bytes of it now (fewer calls per byte)
                                recv_dry, can_recv = True, False
                        if trace is not None:
                            trace.append((time.perf_counter_ns(), "r", index, target.nbytes))
                        counter = recv._in.reserve()
                        if mac is not None and index and target.nbytes >= mac_min:  # frame 0: see run()
                            args = recv._in.data_tag_args(counter, self._length, DATA, target)
                            job = mac.submit(recv._in.gmac, *args)
                            checking.append((index, self._tag, job))
                        else:
                            recv._check(recv._in.data_tag(counter, self._length, DATA, target), self._tag)
                            if checking:  # checked, but handed over after the frames before it
                                checking.append((index, self._tag, None))
                            else:
                                n_recv = hand_over(index)
                        index, target = index + 1, None
                    if index == n_recv and not checking and not pending and not queue_out:
                        break
                    if held and (index == n_recv or received_bytes + ahead > sent_bytes):
                        held = False  # what arrived since allows more: send it before waiting
                    now = time.monotonic()
                    reading = index < n_recv and len(checking) < window
                    if progressed:
                        last = now
                        if spin_until:  # a frame came while this rank spun for it
                            recv.spin_ended(True)
                        spin_until = None
                        # straight to poll when both sides are known to have to wait (saves an iteration whose
                        # two calls would only raise BlockingIOError: ~half the loop's iterations on a link-bound
                        # ring); otherwise (a frame completed, a forward was queued) go round again at once
                        if not ((send_full or tag_wait or held or not (pending or queue_out))
                                and (recv_dry or not reading)):
                            continue
                    elif now - last > self.timeout_s:
                        waiting = recv if index < n_recv else out
                        raise waiting._fail(TimeoutError("no progress"), op)
                    if reading:
                        wanted = len(head) - got_head if target is None else target.nbytes - target_got
                        if wanted < RECV_LOWAT_MIN_BYTES:  # no system call on a small collective's path
                            wanted = 1
                        else:
                            if not lowat_cap:  # a quarter of the receive buffer (autotuned: read once per run)
                                rcvbuf = recv.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                                lowat_cap = max(1, min(RECV_LOWAT_BYTES, rcvbuf // 4))
                                if ahead:  # ``RUN_AHEAD_LOWAT``, ``RUN_AHEAD_WINDOW``
                                    lowat_cap = min(lowat_cap, ahead * RUN_AHEAD_LOWAT[0] // RUN_AHEAD_LOWAT[1])
                                    try:
                                        recv.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP,
                                                             RUN_AHEAD_WINDOW * ahead)
                                    except OSError:  # not TCP (a Unix socket pair)
                                        pass
                            wanted = min(wanted, lowat_cap if index + 1 < n_recv else RECV_LOWAT_TAIL_BYTES)
                        if wanted != lowat:
                            recv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                            lowat = wanted
                    mask_in = select.POLLIN if reading else 0
                    mask_out = select.POLLOUT if (pending or (queue_out and not tag_wait)) and not held else 0
                    if same:
                        want(out.sock.fileno(), mask_in | mask_out)
                    else:
                        want(recv.sock.fileno(), mask_in)
                        want(out.sock.fileno(), mask_out)
                    if mac is not None:
                        awaited = [queue_out[0][2]] if tag_wait else []  # the jobs this rank waits for
                        if checking and checking[0][2] is not None:
                            awaited.append(checking[0][2])
                        want(mac_fd, select.POLLIN if awaited else 0)
                        mac.waiting = True  # then look again: a job that finished meanwhile did not wake us
                        if any(job.done for job in awaited):
                            mac.waiting = False
                            continue
                    wait_ms = max(1, int(min(1.0, self.timeout_s - (now - last)) * 1000))
                    if self.spin and reading and not (pending or queue_out or checking):
                        if spin_until is None:
                            spin_until = recv.spin_deadline(now)
                        if spin_until:
                            if now < spin_until:
                                wait_ms = 0
                            else:
                                recv.spin_ended(False)
                                spin_until = 0.0
                    if held:
                        wait_ms = min(wait_ms, RUN_AHEAD_WAIT_MS)
                    events = poll.poll(wait_ms)
                    if held and not events:  # nothing came for a while: send on until the peer's data does
                        released = received_bytes
                    if wait_ms:  # it slept: the next wait decides afresh
                        spin_until = None
                    for fd, ev in events:
                        if fd == out_fd and ev & _POLL_OUT:
                            can_send = True
                        if fd == recv_fd and ev & _POLL_IN:
                            can_recv = True
                    if mac is not None:
                        mac.waiting = False
                        if any(fd == mac_fd for fd, _ in events):
                            mac.clear()
                if spin_until:  # the last frame came while this rank spun for it
                    recv.spin_ended(True)
                if trace is not None:
                    trace += [(time.perf_counter_ns(), "end", 0, 0), (time.perf_counter_ns(), "tcp", 0,
                                                                       tcp_state(out.sock))]
            except BaseException:
                if pending:  # a frame is half-sent: anything sent after it (an ABORT) would land inside it
                    out.send_broken = True
                raise
            finally:
                for _, _, job in itertools.chain(queue_out, checking):
                    if job is not None:  # an error ends the run: nothing will read these
                        job.cancelled = True
                if queue_out:  # frames never started give their counters back (an ABORT may follow)
                    out._out.counter = queue_out[0][1]
                if lowat != 1:
                    try:
                        recv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                    except OSError:
                        pass
                for peer in (out, recv):
                    try:
                        peer.sock.settimeout(peer.timeout_s)
                    except OSError:
                        pass

    def _start_frame(self, head: bytes, into: memoryview) -> memoryview:
        """Check a received header against the frame expected next; the view to read its payload into."""
        recv = self.recv_peer
        (length,) = _LENGTH.unpack_from(head)
        self._length, self._tag = length, head[_LENGTH.size:HEADER_SIZE]
        kind = head[HEADER_SIZE:]
        if kind != DATA:  # an ABORT (or a stray control frame): read it whole, blocking
            recv.sock.settimeout(recv.timeout_s)
            recv._control(length, self._tag, kind, self.operation)  # raises PeerAbort for an ABORT
            raise recv.unexpected(kind, self.operation)
        if length - 1 != into.nbytes:
            recv.recv_broken = True
            raise ProtocolError(
                f"{self.operation}: rank {recv.rank} sent {length - 1} bytes where {into.nbytes} were expected; "
                "the ranks called collectives in different orders or with different shapes")
        return into


def tcp_state(sock: socket.socket) -> dict[str, int]:
    """A few fields of the socket's ``TCP_INFO`` (Linux): bytes acked, microseconds busy / limited by the receive
    window / by the send buffer, congestion window (segments), smoothed RTT (us), bytes not yet sent, and the
    pacing and last delivery rates (bytes/s)."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 192)
    if len(raw) < 192:
        return {}
    busy, rwnd, sndbuf = struct.unpack_from("QQQ", raw, 168)
    return {"acked": struct.unpack_from("Q", raw, 120)[0], "busy_us": busy, "rwnd_limited_us": rwnd,
            "sndbuf_limited_us": sndbuf, "cwnd": struct.unpack_from("I", raw, 80)[0],
            "rtt_us": struct.unpack_from("I", raw, 68)[0], "notsent": struct.unpack_from("I", raw, 144)[0],
            "pacing_rate": struct.unpack_from("Q", raw, 104)[0], "delivery_rate": struct.unpack_from("Q", raw, 160)[0]}


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
                 secret: bytes, job_id: str, timeout_s: float) -> dict[int, PeerSocket]:
    """Connect every pair of ranks once (rank i dials every lower rank, accepts every higher one).

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
        candidate = PeerSocket(sock, secret, -1, handshake_s)
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
            peer = PeerSocket(sock, secret, j, timeout_s)
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
