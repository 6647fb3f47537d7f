"""The driver-side service of a run (its client in the training processes is ``spark_hvd.runner.client``).

Every rank keeps one TCP connection to the driver (``DriverService``) for the whole run and sends over it,
as HMAC-authenticated frames (``spark_hvd.core.transport.wire.FramedSocket``, checked before anything is unpickled):

- ``("hello", job_id, rank)`` first;
- ``("out", stream, text)``: whole lines of its stdout / stderr, which the driver prints prefixed ``[rank]``;
- ``("event", Event)``: progress from ``report(epoch=..., step=..., **metrics)``;
- ``("error", type, message, traceback)`` when its function raised, ``("done",)`` when it finished;
- ``("req", name, payload)``, answered on the same connection by ``("ok", value)`` or ``("error", message)``: a
  request to one of the service's ``handlers`` (``run_elastic``'s committed state and resize checks);
- ``("alive",)`` every second (``client.ALIVE_EVERY_S``): ``check_liveness(timeout_s)`` blames a rank that has
  sent nothing for ``timeout_s`` (and is not waiting for an answer) as unreachable, the way a host whose link was
  cut shows, long before its peers' collective times out (``SPARK_HVD_TIMEOUT``).

A connection whose hello ends in ``"kv"`` is a rank's torch.distributed rendezvous
(``spark_hvd.core.backends.torch_store``): it is served the KV operations of
``spark_hvd.core.transport.rendezvous.KVTable``, so that the job needs no other port.

A connection first proves the job's secret (challenge-response with fresh nonces, ``Listener``: bounded in time,
a cap on unauthenticated connections, accept errors survived), so a replayed hello is refused. A connection that
closes before ``done`` or ``error`` marks its rank as lost (the process died). A frame that fails its check is
dropped and logged and its connection closed; it never reaches ``pickle``.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.transport.listener import Listener
from spark_hvd.core.transport.rendezvous import KVTable
from spark_hvd.core.transport.wire import FramedSocket
from spark_hvd.runner.client import MAX_FRAME, Event
from spark_hvd.runner.errors import CONSEQUENCE_TYPES, RankFailure
from spark_hvd.runner.horovod_kwargs import OutputStreams
from spark_hvd.runner.progress import ProgressDisplay

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 60.0


class DriverService:
    """Collects output lines, progress events and failures from the ranks of one run.

    Args:
        secret: the job's secret; every frame is checked against it.
        num_proc: number of ranks expected.
        job_id: a hello naming another job is refused.
        verbose: 0 prints nothing; 1 prints the ranks' output and rank 0's progress (``ProgressDisplay``: a bar on
            a terminal or in a notebook, a line per epoch otherwise); 2 every report as a line.
        on_event: called with each ``Event`` as it arrives (on the service's thread).
        on_failure: called once, with the first ``RankFailure``, as soon as one arrives.
        attempt: stored in the events (runs with retries).
        bind_host: interface to listen on ("" = all, for executors on other hosts).
        handlers: request name -> ``handler(rank, payload)``, whose return value is sent back to the rank
            (``ServiceClient.request``); an exception it raises is sent back as an error message.
        encrypt: every connection's frames are encrypted (its ranks' clients must say so too).
    """

    def __init__(self, secret: bytes, num_proc: int, *, job_id: str = "", verbose: int = 1,
                 on_event: Callable[[Event], None] | None = None,
                 on_failure: Callable[[RankFailure], None] | None = None,
                 attempt: int = 0, bind_host: str = "",
                 handlers: dict[str, Callable[[int, Any], Any]] | None = None, encrypt: bool = False,
                 output: OutputStreams | None = None) -> None:
        self.secret = secret
        self.output = output or OutputStreams()
        self.encrypt = encrypt
        self.num_proc = num_proc
        self.job_id = job_id
        self.verbose = verbose
        self.on_event = on_event
        self.on_failure = on_failure
        self.attempt = attempt
        self.bind_host = bind_host
        self.handlers = dict(handlers or {})
        self.events: list[Event] = []
        self.failures: list[RankFailure] = []
        self._bad_frames = 0
        self.started: set[int] = set()
        self.finished: set[int] = set()
        #: each started rank's host, as its connection to the service came from
        self.hosts: dict[int, str] = {}
        #: when each started rank's last frame arrived (``time.monotonic``), and the ranks awaiting an answer
        self._seen: dict[int, float] = {}
        self._asking: set[int] = set()
        #: ranks ``check_liveness`` blamed (counted as finished: nobody waits for them any more)
        self.unreachable: set[int] = set()
        self.changed = threading.Event()
        self._lock = threading.Lock()
        self.display = ProgressDisplay(verbose)
        self._stopping = threading.Event()
        self._cancelled = False
        self._listener: Listener | None = None
        self._kv = KVTable()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> tuple[str, int]:
        """Listen on a free port; returns ``(bound host, port)``."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.bind_host, 0))
        sock.listen(max(16, self.num_proc * 2))
        self._listener = Listener(sock, self.secret, self._serve, name="spark_hvd-driver-service",
                                  encrypt=self.encrypt)
        self._listener.start()
        host, port = sock.getsockname()[:2]
        return host, port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection; joins the accept thread (bounded)."""
        self._stopping.set()
        self._kv.stop()
        if self._listener is not None:
            self._listener.stop(timeout_s)
        self.display.close()

    @property
    def rejected(self) -> int:
        """Connections dropped: failed handshakes (wrong secret, replayed, silent) and frames failing their check."""
        return (self._listener.rejected if self._listener is not None else 0) + self._bad_frames

    def mark_cancelled(self) -> None:
        """From now on, ranks that go away are consequences of the cancellation, not causes."""
        self._cancelled = True

    # ------------------------------------------------------------------ queries
    def all_finished(self, only_started: bool = False) -> bool:
        with self._lock:
            if only_started:
                return self.finished >= self.started
            return len(self.finished) >= self.num_proc

    def wait_finished(self, timeout_s: float, only_started: bool = False) -> bool:
        """Wait (bounded) until every rank (or every rank that connected) has said done/error or gone away."""
        deadline = time.monotonic() + timeout_s
        while not self.all_finished(only_started):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.changed.wait(min(remaining, 0.2))
            self.changed.clear()
        return True

    def root_failure(self) -> RankFailure | None:
        """The failure that most likely caused the others: the first that is not a consequence."""
        with self._lock:
            failures = list(self.failures)
        if not failures:
            return None
        causes = [f for f in failures if not f.consequence]
        return min(causes or failures, key=lambda f: f.time)

    def silent(self) -> list[int]:
        """Ranks that started and have neither reported an end nor closed their connection: a rank whose host went
        unreachable (its link down) or whose process is stuck."""
        with self._lock:
            return sorted(self.started - self.finished)

    def blame_silent(self) -> RankFailure | None:
        """When every failure reported is a consequence (peers timing out on each other in a ring) and some ranks
        went silent, the first silent rank as a ``lost`` failure (added to the failures): it is the likely cause,
        not the first rank whose wait timed out (which names its neighbour, often another victim). None otherwise."""
        root = self.root_failure()
        silent = self.silent()
        if not silent or root is None or not root.consequence:
            return None
        rank = silent[0]
        failure = RankFailure(rank, "lost", "ProcessUnreachable",
                              f"rank {rank}'s process on host {self.hosts.get(rank, '?')} stopped answering: its "
                              "peers timed out waiting for it and it neither finished nor closed its connection to "
                              "the driver (its host is unreachable, e.g. its link is down, or the process is stuck)",
                              time=min((f.time for f in self.failures), default=time.time()) - 1e-3)
        self._add_failure(failure)
        return failure

    def check_liveness(self, timeout_s: float) -> list[RankFailure]:
        """Blame, as ``lost`` failures (``ProcessUnreachable``), the started ranks that have sent nothing for
        ``timeout_s`` seconds though they neither finished nor await an answer; they count as finished from now
        on. Returns the new failures (the first one calls ``on_failure``)."""
        now = time.monotonic()
        with self._lock:
            quiet = sorted(r for r in self.started - self.finished - self._asking
                           if now - self._seen.get(r, now) > timeout_s)
            self.unreachable.update(quiet)
            self.finished.update(quiet)
        found = []
        for rank in quiet:
            failure = RankFailure(rank, "lost", "ProcessUnreachable",
                                  f"rank {rank}'s process on host {self.hosts.get(rank, '?')} stopped answering: it "
                                  f"sent nothing to the driver for {timeout_s:g} s (SPARK_HVD_LIVENESS_TIMEOUT) and "
                                  "neither finished nor closed its connection (its host is unreachable, e.g. its "
                                  "link is down, or the process is frozen)", time=time.time())
            self._add_failure(failure)
            found.append(failure)
        return found

    def sorted_failures(self) -> list[RankFailure]:
        root = self.root_failure()
        with self._lock:
            rest = sorted((f for f in self.failures if f is not root), key=lambda f: f.time)
        return ([root] if root else []) + rest

    # ------------------------------------------------------------------ internals
    def _serve(self, conn: FramedSocket, address: str) -> None:
        """One authenticated connection (on its own thread, see ``Listener``): hello, then messages until done."""
        conn.peer = address
        rank: int | None = None
        finished = False
        try:
            conn.sock.settimeout(HELLO_TIMEOUT_S)  # a connection that never says hello is dropped
            hello = conn.recv_object(max_size=4096)
            conn.sock.settimeout(None)
            if (not isinstance(hello, tuple) or len(hello) != 4 or hello[0] != "hello"
                    or hello[1] != self.job_id or not isinstance(hello[2], int)
                    or not 0 <= hello[2] < self.num_proc or hello[3] not in ("rank", "aux", "kv")):
                logger.warning("driver service: dropped a connection from %s with an unexpected hello", conn.peer)
                return
            if hello[3] == "kv":  # torch.distributed's rendezvous of a rank (spark_hvd.core.backends.torch_store)
                conn.peer = f"rank {hello[2]} (torch.distributed store)"
                self._kv.serve(conn)
                return
            if hello[3] == "aux":  # report() from a helper process: events only, no lifecycle
                conn.peer = f"rank {hello[2]} (helper)"
                while True:
                    msg = conn.recv_object(max_size=MAX_FRAME)
                    if msg[0] == "event":
                        self._add_event(msg[1])
            rank = hello[2]
            conn.peer = f"rank {rank}"
            with self._lock:
                self.started.add(rank)
                self.hosts[rank] = address.rsplit(":", 1)[0]
                self._seen[rank] = time.monotonic()
            self.changed.set()
            while True:
                msg = conn.recv_object(max_size=MAX_FRAME)
                self._seen[rank] = time.monotonic()
                kind = msg[0]
                if kind == "alive":
                    continue
                if kind == "out":
                    self._print_lines(rank, msg[1], msg[2])
                elif kind == "event":
                    self._add_event(msg[1])
                elif kind == "error":
                    finished = True
                    self._add_failure(RankFailure(rank, "exception", msg[1], msg[2], msg[3], time.time(),
                                                  consequence=msg[1] in CONSEQUENCE_TYPES,
                                                  host=self.hosts.get(rank, "")))
                    return
                elif kind == "done":
                    finished = True
                    return
                elif kind == "req":
                    with self._lock:
                        self._asking.add(rank)
                    try:
                        conn.send_object(self._answer(rank, msg[1], msg[2]))
                    finally:
                        with self._lock:
                            self._asking.discard(rank)
                            self._seen[rank] = time.monotonic()
                else:
                    logger.warning("driver service: unknown message %r from rank %s", kind, rank)
        except AuthenticationError:
            with self._lock:
                self._bad_frames += 1
            logger.warning("driver service: dropped a forged or corrupted frame from %s and closed its connection",
                           conn.peer)
        except PeerFailureError:
            if rank is not None and not finished and not self._stopping.is_set():
                self._add_failure(RankFailure(
                    rank, "lost", "ProcessLost",
                    f"rank {rank}'s process on host {address.rsplit(':', 1)[0]} died or closed its connection to "
                    "the driver before finishing",
                    time=time.time(), consequence=self._cancelled, host=address.rsplit(":", 1)[0]))
        except Exception:  # a malformed frame from an authenticated peer: log it, never crash the service
            logger.exception("driver service: error while serving %s", conn.peer)
        finally:
            conn.close()
            if rank is not None:
                with self._lock:
                    self.finished.add(rank)
            self.changed.set()

    def _answer(self, rank: int, name: Any, payload: Any) -> tuple[str, Any]:
        handler = self.handlers.get(name) if isinstance(name, str) else None
        if handler is None:
            return "error", f"the driver service of job {self.job_id} has no handler for request {name!r}"
        try:
            return "ok", handler(rank, payload)
        except Exception as exc:  # the rank gets the message; the service keeps serving
            logger.warning("driver service: request %r of rank %d failed: %s", name, rank, exc)
            return "error", f"{type(exc).__name__}: {exc}"

    def _print_lines(self, rank: int, stream: str, text: str) -> None:
        if self.output.write(rank, stream, text) or self.verbose < 1:
            return
        out = sys.stderr if stream == "stderr" else sys.stdout
        self.display.write(self.output.lines(rank, stream, text, horovod=False), out)

    def _add_event(self, event: Event) -> None:
        if self.attempt and event.attempt != self.attempt:
            event = Event(event.rank, event.epoch, event.step, event.metrics, event.time, self.attempt)
        with self._lock:
            self.events.append(event)
        self.display.show(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                logger.exception("driver service: the on_event callback raised")
        self.changed.set()

    def _add_failure(self, failure: RankFailure) -> None:
        with self._lock:
            first = not self.failures
            self.failures.append(failure)
        self.changed.set()
        if first and self.on_failure is not None:
            try:
                self.on_failure(failure)
            except Exception:
                logger.exception("driver service: the on_failure callback raised")
