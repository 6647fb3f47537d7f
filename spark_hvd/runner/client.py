"""A rank's end of the driver service (``spark_hvd.runner.service``): the connection (``ServiceClient``), the
progress messages it sends (``Event``, ``report()``), and the forwarding of the process's stdout/stderr.

The frames and their order are described in ``spark_hvd.runner.service``; both ends check every frame's MAC
(``spark_hvd.core.transport.wire.FramedSocket``) before anything is unpickled.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport.wire import FramedSocket
from spark_hvd.runner.errors import RunnerError

logger = logging.getLogger(__name__)

SERVICE_ENV = "SPARK_HVD_DRIVER_SERVICE"
#: the largest frame either end of the connection accepts
MAX_FRAME = 64 << 20
#: a rank's connection sends ``("alive",)`` this often (seconds), so the driver tells a rank whose host went
#: unreachable from one that is merely busy (``DriverService.check_liveness``)
ALIVE_EVERY_S = 1.0


@dataclass(frozen=True)
class Event:
    """One progress report of a rank: ``report(epoch=..., step=..., **metrics)``."""

    rank: int
    epoch: int | None
    step: int | None
    metrics: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    attempt: int = 0


def _plain(value: Any) -> Any:
    """Numpy / torch / tf scalars to plain Python numbers so events unpickle anywhere."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            return value
    return value


class ServiceClient:
    """A rank's connection to the driver service (thread-safe; silently disabled if the driver goes away).

    ``role="rank"`` is the rank's own connection, whose end (done, error, or closed) the driver tracks, and which
    a thread keeps saying ``("alive",)`` on every ``ALIVE_EVERY_S`` until ``close()``; ``role="aux"`` only carries
    ``report()`` events (a launched process, or a helper process of a rank).
    ``encrypt``: as the service does (``JobEnv.encrypt``).
    """

    def __init__(self, address: str, secret: bytes, job_id: str, rank: int, *, attempt: int = 0,
                 timeout_s: float = 60.0, role: str = "rank", encrypt: bool = False) -> None:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rank = rank
        self.attempt = attempt
        self._conn = FramedSocket(sock, secret, "driver", encrypt)
        try:
            self._conn.handshake("client", timeout_s)
        except BaseException:
            self._conn.close()
            raise
        self._lock = threading.Lock()
        self._alive = True
        self._closed = threading.Event()
        self.pid = os.getpid()
        self._send(("hello", job_id, rank, role))
        if role == "rank":
            threading.Thread(target=self._keep_alive, name="spark_hvd-alive", daemon=True).start()

    def _keep_alive(self) -> None:
        """Say ``("alive",)`` every ``ALIVE_EVERY_S`` until closed (skipped while another message is being sent or
        a request awaits its answer: the driver counts those as signs of life too)."""
        while not self._closed.wait(ALIVE_EVERY_S):
            if not self._alive:
                return
            if self._lock.acquire(timeout=ALIVE_EVERY_S):
                try:
                    if self._alive:
                        self._conn.send_object(("alive",))
                except PeerFailureError as exc:
                    self._alive = False
                    logger.warning("rank %d lost its connection to the driver service: %s", self.rank, exc)
                finally:
                    self._lock.release()

    def _send(self, msg: tuple) -> None:
        with self._lock:
            if not self._alive:
                return
            try:
                self._conn.send_object(msg)
            except PeerFailureError as exc:
                self._alive = False
                logger.warning("rank %d lost its connection to the driver service: %s", self.rank, exc)

    def send_output(self, stream: str, text: str) -> None:
        self._send(("out", stream, text))

    def send_event(self, epoch: int | None, step: int | None, metrics: dict[str, Any]) -> None:
        plain = {str(k): _plain(v) for k, v in metrics.items()}
        self._send(("event", Event(self.rank, epoch, step, plain, time.time(), self.attempt)))

    def send_error(self, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._send(("error", type(exc).__name__, str(exc), tb))

    def request(self, name: str, payload: Any = None, max_size: int = MAX_FRAME) -> Any:
        """Ask the driver service's handler ``name`` and return its answer (``RunnerError`` with the driver's
        message when it failed or the driver is gone)."""
        with self._lock:
            if not self._alive:
                raise RunnerError(f"rank {self.rank}: request {name!r}: the connection to the driver service is closed")
            try:
                self._conn.send_object(("req", name, payload))
                status, value = self._conn.recv_object(max_size=max_size)
            except PeerFailureError as exc:
                self._alive = False
                raise RunnerError(f"rank {self.rank}: request {name!r} to the driver service failed: {exc}") from exc
        if status != "ok":
            raise RunnerError(f"rank {self.rank}: the driver refused request {name!r}: {value}")
        return value

    def send_done(self) -> None:
        self._send(("done",))

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._alive = False
            self._conn.close()


_client: ServiceClient | None = None
_client_from_env = False
_client_lock = threading.Lock()


def set_client(client: ServiceClient | None) -> None:
    """Install the connection ``report()`` uses in this process (the Spark task wrapper does this)."""
    global _client, _client_from_env
    with _client_lock:
        _client = client
        _client_from_env = False


def current_client() -> ServiceClient | None:
    """This process's connection to the driver service: the one ``set_client`` installed, else one opened (once
    per process) from ``SPARK_HVD_DRIVER_SERVICE`` and the job's environment; None outside a run."""
    global _client, _client_from_env
    with _client_lock:
        if _client is not None and _client.pid == os.getpid():
            return _client
        if _client is not None:  # a forked child must not write on its parent's connection
            _client, _client_from_env = None, False
        address = os.environ.get(SERVICE_ENV)
        if not address or _client_from_env:
            return None
        _client_from_env = True  # try once per process
        try:
            job = JobEnv.from_env()
            if job is None or job.secret is None:
                raise ValueError("this process is not a rank of a job: SPARK_HVD_RANK/_SIZE/_SECRET are not set")
            _client = ServiceClient(address, job.secret, job.job_id, job.rank, attempt=job.attempt, timeout_s=30.0,
                                    role="aux", encrypt=job.encrypt)
        except (OSError, ValueError, AuthenticationError, PeerFailureError) as exc:
            logger.warning("report(): cannot reach the driver service at %s (%s); reports are dropped", address, exc)
            _client = None
        return _client


def report(epoch: int | None = None, step: int | None = None, **metrics: Any) -> None:
    """Send a progress event (epoch, step, metrics such as ``loss=0.3``) to the driver of the run.

    Call it from training code running under ``spark_hvd.runner.run`` or ``spark-hvd-run``; the driver shows it
    (``verbose``) and hands the events to the caller of ``run`` (``on_event``, ``last_events()``). Outside a run
    it does nothing. Numpy / torch scalars are turned into Python numbers.
    """
    client = current_client()
    if client is not None:
        client.send_event(epoch, step, metrics)


class OutputForwarder:
    """Forwards this process's stdout and stderr (file descriptors 1 and 2) to the driver, line by line.

    Works at the descriptor level, so output of C extensions and of logging handlers bound to the old
    ``sys.stderr`` is forwarded too; every line is also written to the original descriptor (executor logs).
    ``stop()`` restores the descriptors; it is bounded even if a child process still holds the pipes. ``tee=False``
    skips the copy to the original descriptors (local mode, where the executor's log is the driver's console).
    """

    def __init__(self, client: ServiceClient, tee: bool = True) -> None:
        self.client = client
        self.tee = tee
        self._saved: dict[int, int] = {}
        self._readers: list[tuple[int, threading.Thread]] = []
        self._line_buffering: dict[str, bool] = {}

    def start(self) -> None:
        _flush_std()
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read_fd, write_fd = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_fd, fd)
            os.close(write_fd)
            thread = threading.Thread(target=self._pump, args=(read_fd, stream, self._saved[fd]),
                                      name=f"spark_hvd-forward-{stream}", daemon=True)
            thread.start()
            self._readers.append((read_fd, thread))
        for name in ("stdout", "stderr"):
            stream_obj = getattr(sys, name, None)
            if stream_obj is not None and hasattr(stream_obj, "reconfigure"):
                try:
                    self._line_buffering[name] = stream_obj.line_buffering
                    stream_obj.reconfigure(line_buffering=True)
                except (AttributeError, ValueError, OSError):
                    pass

    def _pump(self, read_fd: int, stream: str, original_fd: int) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                if self.tee:
                    try:
                        os.write(original_fd, chunk)
                    except OSError:
                        pass
                pending += chunk
                head, sep, tail = pending.rpartition(b"\n")
                if sep:
                    self.client.send_output(stream, head.decode("utf-8", "replace"))
                    pending = tail
        except OSError:
            pass
        finally:
            if pending:
                self.client.send_output(stream, pending.decode("utf-8", "replace"))
            try:
                os.close(read_fd)
            except OSError:
                pass

    def stop(self, timeout_s: float = 5.0) -> None:
        _flush_std()
        for name, value in self._line_buffering.items():
            stream_obj = getattr(sys, name, None)
            try:
                stream_obj.reconfigure(line_buffering=value)
            except (AttributeError, ValueError, OSError):
                pass
        self._line_buffering.clear()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # drops our write end of the pipe: the reader sees EOF
        deadline = time.monotonic() + timeout_s
        for _read_fd, thread in self._readers:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("output forwarding did not drain (a child process may still hold stdout/stderr)")
        for saved in self._saved.values():
            try:
                os.close(saved)
            except OSError:
                pass
        self._saved.clear()
        self._readers.clear()


def _flush_std() -> None:
    for stream_obj in (sys.stdout, sys.stderr):
        try:
            if stream_obj is not None:
                stream_obj.flush()
        except (OSError, ValueError):
            pass
