"""The ring's exchange loop in Python: ``RingExchange``, the twin of ``Ring`` / ``run_ring`` in ``../_ringloop.c``.

One object per exchange, its fields those of the C loop's ``Ring`` struct (the peers, the frames to send first and
the frames planned to arrive, the frame counters' owners, the run-ahead allowance, the receive low-water marks; then
the loop's state: the send queue, the frame being sent (``pending``), the header and frame being received, the bytes
sent and received, whether each socket may take / give more), and its methods the C loop's sections in the same
order: send as much as the socket takes, receive what has arrived (a frame checked before it is used, then handed
over and perhaps queued to go on), and wait in ``poll`` when both sides must. Both loops put the same frames, tags
and counters on the wire and follow the same run-ahead rule, so two ranks on one connection may run either
(``tests/core/test_ring.py``: the interoperation tests).

With encryption (``PeerSocket.encrypt``, both ends of both connections) a frame to send is sealed (ciphertext and
tag, ``wire._Direction.seal``) when its tag would be computed, and its ciphertext is sent in place of the payload;
a frame received is read into a staging buffer and decrypted from there into the view it was planned for
(``open_into``), which says whether its tag checked out: as without encryption, nothing is reduced, forwarded or
handed over before it did (a failed frame leaves its view undefined, and the exchange raises). The C loop does the
same.

What the Python loop has that the C one does not: a caller's ``on_received`` where the C loop reduces and forwards
by plan itself; the small-message spin (``SPIN_S``); and the per-frame timeline ``TRACE``.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.core.transport.tcp.peer import DATA, PeerSocket, ProtocolError
from spark_hvd.core.transport.wire import _COUNTER, _LENGTH, _NONCE_PAD, HEADER_SIZE, TAG_SIZE

#: Large payloads go out in frames of at most this many bytes (bounded sendall time, hashing overlaps sending).
#: With whole frames read per wake-up a frame's fixed cost (tag call, header, hand-over, reduce call, poll, two
#: system calls) is most of the Python left per byte (issue 23's CPU per byte). A ring chunk still goes in at
#: least ``SUB_CHUNKS`` frames, so only chunks above 4 * 2 MiB get frames above 2 MiB (at np=2, arrays above
#: 16 MiB). np=2 across two simulated hosts at 2 Gbit/s, CPU per allreduce per rank at 16 / 64 MiB, 10
#: alternated rounds at load ~20 (session 5): 1 MiB 11.6 / 45.2 ms, 2 MiB 10.9 / 42.7, 4 MiB 10.7 / 41.2 (gloo
#: 12.1 / 41.8), wall time level; session 6, interleaved in one invocation at load 7-10: 64 MiB bare ring 45.2 ->
#: 43.8 ms, api 46.2 -> 41.2 ms (gloo 43.9).
FRAME_BYTES = 4 * 1024 * 1024
#: The ring splits each step's chunk into ``SUB_CHUNKS`` sub-chunks (frames), each of at least this size (fewer,
#: larger frames for small chunks: a frame's fixed cost, tag, system calls, Python, is ~20-30 us) and at most the
#: backend's frame size, so a ring step still pipelines over at least 4 frames.
SUB_CHUNK_MIN_BYTES = 256 * 1024
SUB_CHUNKS = 4
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
RECV_LOWAT_MIN_BYTES = 16 * 1024
#: ``benchmarks/allreduce.py`` with ``BENCH_TRACE`` sets a list here, and ``RingExchange.run`` appends its per-frame
#: timeline to it: (``time.perf_counter_ns()``, event, frame, bytes) for "run" (start: frames to send, to receive),
#: "s0" / "s1" (a frame's first ``sendmsg`` / its last byte handed to the kernel, with the send socket's
#: ``tcp_state`` then), "r" (frame i's last byte received), "c" / "a" (its hand-over to the collective starts /
#: ends), "end", and "tcp" (the send socket's ``tcp_state`` at the start and the end). None (the default): nothing
#: is recorded.
TRACE: list[tuple[int, str, int, Any]] | None = None
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR
_POLL_OUT = select.POLLOUT | select.POLLHUP | select.POLLERR


class RingExchange:
    """Streams DATA frames to one neighbour and from another in the calling thread (non-blocking sockets, poll).

    A ring step's receive, reduce and send overlap without thread hand-offs: while a frame is being received the
    kernel drains the frames already handed to the outgoing socket, and each frame is verified, used and (if the
    ring forwards it) queued for sending as soon as it is complete. ``run`` returns when every expected frame
    arrived and every queued frame left; nothing waits longer than ``timeout_s`` without progress.

    A received frame's tag is checked as soon as it is complete, before it is handed to ``on_received``: nothing
    is reduced, forwarded or returned before its check, and a failed check raises ``AuthenticationError`` naming
    the peer.

    The fields below ``run``'s first line are those of ``Ring`` in ``_ringloop.c`` (names as there where the
    idea is the same: ``out_fd`` / ``in_fd`` for ``send_peer`` / ``recv_peer``'s sockets, ``queue`` for the send
    queue, ``pending`` for the frame being sent, ``head`` / ``got_head`` / ``target`` / ``target_got`` for the frame
    being received).
    """

    __slots__ = (
        # set once (the exchange)
        "send_peer", "recv_peer", "operation", "timeout_s", "spin",
        # one run: its frames (C: first, plan, n_recv, index) and its hand-over (C: reduce / forward by plan)
        "receives", "on_received", "n_recv", "index",
        # sending (C: queue / q_head / q_tail, pending / n_pending, sent_bytes, can_send)
        "queue", "pending", "sent_bytes", "can_send",
        # receiving (C: head, got_head, target / have_target, target_got, in_length_kind, expected_tag, ...)
        "head", "head_view", "got_head", "target", "target_got", "length", "tag", "received_bytes",
        "can_recv", "encrypt", "stage", "dest",
        # the sockets, the run-ahead rule and the waits (C: out_fd, in_fd, same, ahead, released, lowat, last)
        "out_fd", "in_fd", "same", "ahead", "released", "lowat", "lowat_cap", "last", "spin_until", "poll", "polled",
        "trace",
        # one pass of the loop (C: the locals of its body)
        "progressed", "send_full", "recv_dry", "held",
    )

    def __init__(self, send_peer: PeerSocket, recv_peer: PeerSocket, operation: str, spin: bool = False) -> None:
        self.send_peer, self.recv_peer, self.operation = send_peer, recv_peer, operation
        self.timeout_s = max(send_peer.timeout_s, recv_peer.timeout_s)
        self.spin = spin  # the small-message path: poll again at once for a while before sleeping (``SPIN_S``)

    def run(self, sends: Sequence[memoryview], receives: Sequence[memoryview],
            on_received: Callable[[int], memoryview | list[memoryview] | None]) -> None:
        """Send ``sends``; receive frame i into ``receives[i]``, then call ``on_received(i)``, which may return a
        view (or a list of views) to send next. ``receives[i]`` is read when frame i starts, and ``on_received(0)``
        may shorten ``receives`` (a list) to expect fewer frames (``spark_hvd.core.algorithms.agreed``: what a first
        frame answered decides what follows it). Frame i is handed over before a byte of frame i + 1's payload is
        read (receive views may alias: one scratch frame reused); the tail of frame i >= 1 is read together with
        frame i + 1's header (one system call) when frame i + 1 is expected, so only frame 0's answer may change how
        many frames follow. Nothing past the last expected frame is read.
        """
        out, recv = self.send_peer, self.recv_peer
        self.receives, self.on_received = receives, on_received
        self.n_recv, self.index = len(receives), 0
        self.queue: collections.deque[tuple[memoryview, int]] = collections.deque()
        self.pending: list[memoryview] = []  # the frame being sent: what is left of [header, payload]
        self.sent_bytes, self.can_send = 0, True  # try each side until it would block, then wait for poll
        self.head = bytearray(HEADER_SIZE + 1)
        self.head_view = memoryview(self.head)
        self.got_head, self.target, self.target_got = 0, None, 0
        self.encrypt = out.encrypt
        if recv.encrypt != out.encrypt:
            raise ValueError("a ring exchange encrypts on both of its connections or on neither")
        self.stage: memoryview | None = None  # encrypted frames: the ciphertext of the frame being read, its tag
        self.dest: memoryview | None = None  # ... and the view it is decrypted into
        self.received_bytes, self.can_recv = 0, True
        self.out_fd, self.in_fd = out.sock.fileno(), recv.sock.fileno()
        self.same = self.out_fd == self.in_fd
        self.ahead = run_ahead_bytes(out, recv)
        self.released = -1  # ``received_bytes`` when a hold last ran out (``RUN_AHEAD_WAIT_MS``): none until more
        self.lowat, self.lowat_cap = 1, 0
        self.last = time.monotonic()
        self.spin_until: float | None = None  # this wait's spin: None undecided, 0.0 none, else until when
        self.poll = select.poll()
        self.polled: dict[int, int] = {}  # fd -> events registered with ``poll``
        trace = self.trace = TRACE
        if trace is not None:
            trace += [(time.perf_counter_ns(), "run", len(sends), self.n_recv), (time.perf_counter_ns(), "tcp", 0,
                                                                                  tcp_state(out.sock))]
        for payload in sends:
            self._enqueue(payload)
        with out.send_lock:
            try:
                out.sock.settimeout(0.0)
                recv.sock.settimeout(0.0)
                self._loop()
            except BaseException:
                if self.pending:  # a frame is half-sent: anything sent after it (an ABORT) would land inside it
                    out.send_broken = True
                raise
            finally:
                self._done()

    # -- the loop (C: run_ring) --------------------------------------------------------------------------------
    def _loop(self) -> None:
        recv, queue, timeout_s = self.recv_peer, self.queue, self.timeout_s
        send, receive, set_lowat, wait, monotonic = self._send, self._receive, self._set_lowat, self._wait, \
            time.monotonic  # (looked up once: the loop may go round hundreds of times)
        while self.index < self.n_recv or self.pending or queue:
            self.progressed = False
            can_send, can_recv = self.can_send, self.can_recv
            self.send_full, self.recv_dry, self.held = not can_send, not can_recv, False
            if can_send and (self.pending or queue):
                send()
            index, n_recv = self.index, self.n_recv
            if index < n_recv:
                receive()
                index, n_recv = self.index, self.n_recv
            pending = self.pending
            if index == n_recv and not pending and not queue:
                break
            held = self.held
            if held and (index == n_recv or self.received_bytes + self.ahead > self.sent_bytes):
                self.held = held = False  # what arrived since allows more: send it before waiting
            now = monotonic()
            reading = index < n_recv
            if self.progressed:
                self.last = now
                if self.spin_until:  # a frame came while this rank spun for it
                    recv.spin_ended(True)
                self.spin_until = None
                # straight to poll when both sides are known to have to wait (saves an iteration whose two calls
                # would only raise BlockingIOError: ~half the loop's iterations on a link-bound ring); otherwise (a
                # frame completed, a forward was queued) go round again at once
                if not ((self.send_full or held or not (pending or queue))
                        and (self.recv_dry or not reading)):
                    continue
            elif now - self.last > timeout_s:
                waiting = recv if index < n_recv else self.send_peer
                raise waiting._fail(TimeoutError("no progress"), self.operation)
            if reading:
                set_lowat()
            wait(now, reading)
        if self.spin_until:  # the last frame came while this rank spun for it
            recv.spin_ended(True)
        trace = self.trace
        if trace is not None:
            trace += [(time.perf_counter_ns(), "end", 0, 0), (time.perf_counter_ns(), "tcp", 0,
                                                               tcp_state(self.send_peer.sock))]

    def _done(self) -> None:
        """After the loop, however it ended (C: ``done:``): frames never started give their counters back (an ABORT
        may follow), the low-water mark and timeouts are put back."""
        if self.queue:
            self.send_peer._out.counter = self.queue[0][1]
        recv = self.recv_peer
        if self.lowat != 1:
            try:
                recv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass
        for peer in (self.send_peer, recv):
            try:
                peer.sock.settimeout(peer.timeout_s)
            except OSError:
                pass

    # -- sending ---------------------------------------------------------------------------------------------
    def _enqueue(self, payload: memoryview) -> None:
        """Queue a frame to send, its counter taken now (frames leave in counter order)."""
        self.queue.append((payload, self.send_peer._sending().reserve()))

    def _send(self) -> None:
        """Send as much as the socket takes, within the run-ahead allowance (a short send: its buffer is full,
        wait for POLLOUT)."""
        out, queue, pending, trace = self.send_peer, self.queue, self.pending, self.trace
        ahead, sent_bytes = self.ahead, self.sent_bytes
        while self.can_send and (pending or queue):
            if not pending:
                payload, counter = queue[0]
                if self.encrypt:  # sealed into the socket's send stage (free: nothing is pending)
                    tag = out.stage("send", payload.nbytes + TAG_SIZE)
                    out._out.seal_to(counter, payload.nbytes + 1, DATA, payload, tag)
                else:
                    tag = out._out.data_tag(counter, payload.nbytes + 1, DATA, payload)
                queue.popleft()
                if trace is not None:
                    trace.append((time.perf_counter_ns(), "s0", counter, payload.nbytes))
                if self.encrypt:  # ``tag``: the ciphertext, then the tag
                    payload, tag = memoryview(tag)[:-TAG_SIZE], bytes(tag[-TAG_SIZE:])
                pending = self.pending = [memoryview(_LENGTH.pack(payload.nbytes + 1) + tag[-TAG_SIZE:] + DATA),
                                          payload]
            offer = pending
            if ahead and self.index < self.n_recv and self.received_bytes != self.released:
                allowed = self.received_bytes + ahead - sent_bytes
                if allowed <= 0:  # this rank is ``ahead`` bytes ahead of its peer: wait for its data
                    self.held = True
                    break
                if allowed < sum(view.nbytes for view in pending):
                    offer = [pending[0][:allowed]] if allowed <= pending[0].nbytes else \
                        [pending[0], pending[1][:allowed - pending[0].nbytes]]
            try:
                sent = out.sock.sendmsg(offer)
            except (BlockingIOError, InterruptedError):
                self.send_full = True
                self.can_send = False
                break
            except OSError as exc:
                out.send_broken = True
                raise out._fail(exc, self.operation) from exc
            self.progressed = True
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
                self.send_full = True
                self.can_send = False
                break
        self.sent_bytes = sent_bytes

    # -- receiving -------------------------------------------------------------------------------------------
    def _receive(self) -> None:
        """Receive what has arrived: read headers and payloads as far as the socket gives them, check each
        complete frame's tag and hand it over."""
        recv, receives = self.recv_peer, self.receives
        head, head_view, head_size = self.head, self.head_view, HEADER_SIZE + 1
        index, n_recv, got_head, target, target_got = self.index, self.n_recv, self.got_head, self.target, \
            self.target_got
        received_bytes, can_recv, recv_dry = self.received_bytes, self.can_recv, self.recv_dry
        while index < n_recv:
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
                        # the rest of this frame and the next one's header in one call (not past frame 0,
                        # whose answer may change what follows, nor past the last frame)
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
                    raise recv._fail(exc, self.operation) from exc
                if n == 0:
                    recv.recv_broken = True
                    raise recv._fail(ConnectionError("connection closed by peer"), self.operation)
                received_bytes += n
                self.progressed = True
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
                    # a large frame is complete: let poll say when the next one is (its low-water mark)
                    # rather than read a few bytes of it now (fewer calls per byte)
                    recv_dry, can_recv = True, False
            # frame ``index`` is complete: check its tag before anything uses it
            if self.trace is not None:
                self.trace.append((time.perf_counter_ns(), "r", index, target.nbytes))
            counter = recv._in.reserve()
            if self.encrypt:  # the ciphertext in ``stage``: its tag after it, then decrypted into ``dest``
                stage, n = self.stage, target.nbytes
                stage[n:n + TAG_SIZE] = self.tag
                if not recv._in.open_into(_NONCE_PAD + _COUNTER.pack(counter), _LENGTH.pack(self.length) + DATA,
                                          stage, self.dest):
                    recv._rejected()
            else:
                recv._check(recv._in.data_tag(counter, self.length, DATA, target), self.tag)
            n_recv = self._hand_over(index)
            index, target = index + 1, None
        # (an error ends the run: nothing reads these after one)
        self.index, self.n_recv, self.got_head, self.target, self.target_got = index, n_recv, got_head, target, \
            target_got
        self.received_bytes, self.can_recv, self.recv_dry = received_bytes, can_recv, recv_dry

    def _start_frame(self, head: bytes, into: memoryview) -> memoryview:
        """Check a received header against the frame expected next; the view to read its payload into."""
        recv = self.recv_peer
        (length,) = _LENGTH.unpack_from(head)
        self.length, self.tag = length, head[_LENGTH.size:HEADER_SIZE]
        kind = head[HEADER_SIZE:]
        if kind != DATA:  # an ABORT (or a stray control frame): read it whole, blocking
            recv.sock.settimeout(recv.timeout_s)
            recv._control(length, self.tag, kind, self.operation)  # raises PeerAbort for an ABORT
            raise recv.unexpected(kind, self.operation)
        if length - 1 != into.nbytes:
            recv.recv_broken = True
            raise ProtocolError(
                f"{self.operation}: rank {recv.rank} sent {length - 1} bytes where {into.nbytes} were expected; "
                "the ranks called collectives in different orders or with different shapes")
        if self.encrypt:  # read the ciphertext aside (the tag after it), decrypted into ``into`` once complete
            self.dest = into  # decrypted here, before the next frame is read
            self.stage = recv.stage("recv", into.nbytes + TAG_SIZE)
            return self.stage[:into.nbytes]
        return into

    def _hand_over(self, i: int) -> int:
        """``on_received(i)``, its answer queued to send; returns how many frames are now expected."""
        trace = self.trace
        if trace is not None:
            trace.append((time.perf_counter_ns(), "c", i, 0))
        forward = self.on_received(i)
        if trace is not None:
            trace.append((time.perf_counter_ns(), "a", i, 0))
        if forward.__class__ is list:
            for view in forward:
                self._enqueue(view)
        elif forward is not None:
            self._enqueue(forward)
        return len(self.receives)

    # -- waiting ---------------------------------------------------------------------------------------------
    def _set_lowat(self) -> None:
        """Wake for the rest of the frame being read, up to the cap (C: set_lowat's caller)."""
        recv = self.recv_peer
        wanted = len(self.head) - self.got_head if self.target is None else self.target.nbytes - self.target_got
        if wanted < RECV_LOWAT_MIN_BYTES:  # no system call on a small collective's path
            wanted = 1
        else:
            if not self.lowat_cap:  # read once per run
                self.lowat_cap = recv_lowat_cap(recv, self.ahead)
            wanted = min(wanted, self.lowat_cap if self.index + 1 < self.n_recv else RECV_LOWAT_TAIL_BYTES)
        if wanted != self.lowat:
            recv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
            self.lowat = wanted

    def _want(self, fd: int, events: int) -> None:
        polled = self.polled
        if polled.get(fd, 0) != events:
            if events:
                self.poll.register(fd, events)
                polled[fd] = events
            else:
                self.poll.unregister(fd)
                del polled[fd]

    def _wait(self, now: float, reading: bool) -> None:
        """Wait in ``poll`` for either socket to be ready, at most until the timeout's end (a held rank:
        ``RUN_AHEAD_WAIT_MS``; the small-message path spins first)."""
        recv, held, out_fd, in_fd = self.recv_peer, self.held, self.out_fd, self.in_fd
        mask_in = select.POLLIN if reading else 0
        mask_out = select.POLLOUT if (self.pending or self.queue) and not held else 0
        if self.same:
            self._want(out_fd, mask_in | mask_out)
        else:
            self._want(in_fd, mask_in)
            self._want(out_fd, mask_out)
        wait_ms = max(1, int(min(1.0, self.timeout_s - (now - self.last)) * 1000))
        if self.spin and reading and not (self.pending or self.queue):
            if self.spin_until is None:
                self.spin_until = recv.spin_deadline(now)
            if self.spin_until:
                if now < self.spin_until:
                    wait_ms = 0
                else:
                    recv.spin_ended(False)
                    self.spin_until = 0.0
        if held:
            wait_ms = min(wait_ms, RUN_AHEAD_WAIT_MS)
        events = self.poll.poll(wait_ms)
        if held and not events:  # nothing came for a while: send on until the peer's data does
            self.released = self.received_bytes
        if wait_ms:  # it slept: the next wait decides afresh
            self.spin_until = None
        for fd, ev in events:
            if fd == out_fd and ev & _POLL_OUT:
                self.can_send = True
            if fd == in_fd and ev & _POLL_IN:
                self.can_recv = True


def run_ahead_bytes(out: PeerSocket, recv: PeerSocket) -> int:
    """How far an exchange sending on ``out`` and receiving on ``recv`` may run ahead of its peer: where two ranks
    share one connection, at most ``RUN_AHEAD_BYTES`` more handed to the kernel than have arrived from the peer while
    more is expected, so neither direction runs ahead of the other; 0 (no limit) otherwise. Both loops' rule."""
    return RUN_AHEAD_BYTES if out.sock.fileno() == recv.sock.fileno() and out.couples_directions() else 0


def recv_lowat_cap(recv: PeerSocket, ahead: int) -> int:
    """The most a read on ``recv`` asks the kernel to wait for (SO_RCVLOWAT): a quarter of its receive buffer (as
    autotuned now) up to ``RECV_LOWAT_BYTES``; with a run-ahead allowance ``ahead``, at most ``RUN_AHEAD_LOWAT`` of
    it, and the connection's receive window clamped (``RUN_AHEAD_WINDOW``). Both loops' rule."""
    rcvbuf = recv.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    cap = max(1, min(RECV_LOWAT_BYTES, rcvbuf // 4))
    if ahead:
        cap = min(cap, ahead * RUN_AHEAD_LOWAT[0] // RUN_AHEAD_LOWAT[1])
        try:
            recv.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, RUN_AHEAD_WINDOW * ahead)
        except OSError:  # not TCP (a Unix socket pair)
            pass
    return cap


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
