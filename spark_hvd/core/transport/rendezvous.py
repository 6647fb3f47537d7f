"""Rendezvous: how the ranks of a job learn each other's addresses.

``KVStoreServer`` is a small key-value service (one thread per connection, accepted by the surviving
``spark_hvd.core.transport.listener.Listener``) that the launcher runs; ranks talk to it with ``KVClient`` and exchange
their addresses with ``KVRendezvous``. Its operations live in ``KVTable``, which the Spark runner's driver service
serves too, so that torch.distributed groups meet through either (``spark_hvd.core.backends.torch_store``). Every
connection proves the job's secret with a fresh challenge-response, and every frame in both directions is an
authenticated ``FramedSocket`` frame: a frame that fails its check is dropped and logged and its connection closed, and
it is never unpickled. A replayed connection fails the handshake.

Other rendezvous (the Spark runner's fresh processes asking their parent task, a static list in tests) are small
subclasses of ``spark_hvd.core.backend.Rendezvous``; ``StaticRendezvous`` is the trivial one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from spark_hvd.core.backend import Rendezvous
from spark_hvd.core.errors import AuthenticationError, CollectiveTimeoutError, PeerFailureError, SparkHvdError
from spark_hvd.core.transport.addresses import non_loopback_address, route_towards
from spark_hvd.core.transport.listener import Listener
from spark_hvd.core.transport.wire import FramedSocket

logger = logging.getLogger(__name__)

#: Largest frame the KV service accepts (a forged length beyond it is dropped before any allocation).
MAX_KV_FRAME = 256 * 1024 * 1024


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not of the form host:port")
    return host.strip("[]"), int(port)


def routable_address(towards: str | None = None) -> str:
    """An address of this host that peers can reach: routed towards ``towards`` (a host name or IP of the driver /
    rendezvous) where given and routable, else a non-loopback address of this host
    (``spark_hvd.core.transport.addresses``). Loopback stays loopback."""
    found = route_towards(towards) if towards else None
    return found if found is not None else non_loopback_address()


class KVTable:
    """The data of a KV service and the operations on it, thread-safe: one per ``KVStoreServer``, and one in the
    Spark runner's driver service (``spark_hvd.runner.service``), which serves the same operations to connections
    that say so in their hello.

    Operations (pickled tuples inside authenticated frames): ``("set", key, value)``, ``("get", keys, timeout_s)``
    (waits until every key exists or the timeout passes, then answers the values present), ``("incr", key)``
    (atomic counter in its own namespace, returns the new value), ``("delete", prefix)``; and those a
    ``torch.distributed`` store needs (``spark_hvd.core.backends.torch_store``): ``("add", key, amount)`` (the value is
    a decimal integer, as in torch's stores; returns the new one), ``("cas", key, expected, desired)`` (torch's
    ``compare_set``: returns the value after the call), ``("wait", keys, timeout_s)`` (returns the keys still
    missing), ``("check", keys)``, ``("delete_key", key)`` (True when it existed) and ``("count", prefix)``.
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._counters: dict[str, int] = {}
        self._cond = threading.Condition()
        self._stopped = False

    def stop(self) -> None:
        """Release every waiting ``get``/``wait`` (they answer what is present)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def serve(self, framed: FramedSocket) -> None:
        """Answer the requests of one authenticated connection until it goes away or the table stops.

        A frame that fails its check raises ``AuthenticationError`` (the caller logs it and closes the connection);
        a peer that goes away ends the loop quietly.
        """
        while not self._stopped:
            try:
                request = framed.recv_object(MAX_KV_FRAME)
                framed.send_object(self.apply(request))
            except PeerFailureError:
                return

    def _wait_for(self, keys: Sequence[str], timeout_s: float) -> None:
        """With the condition held: until every key exists, the timeout passes or the table stops."""
        deadline = time.monotonic() + float(timeout_s)
        while not self._stopped and not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(left, 1.0))

    def apply(self, request: Any) -> tuple[Any, ...]:
        """The answer to one request: ``("ok", result)``, or ``("error", why)``."""
        if not isinstance(request, tuple) or not request or not isinstance(request[0], str):
            return ("error", f"malformed request {type(request).__name__}")
        handler = getattr(self, f"_op_{request[0]}", None)
        if handler is None:
            return ("error", f"unknown operation {request[0]!r}")
        try:
            with self._cond:
                return ("ok", handler(*request[1:]))
        except (TypeError, ValueError) as exc:  # wrong arity or types from an authenticated but confused client
            return ("error", f"bad {request[0]!r} request: {exc}")

    def _op_set(self, key: str, value: bytes) -> None:
        self._data[key] = bytes(value)
        self._cond.notify_all()

    def _op_get(self, keys: Sequence[str], timeout_s: float) -> dict[str, bytes]:
        self._wait_for(keys, timeout_s)
        return {k: self._data[k] for k in keys if k in self._data}

    def _op_incr(self, key: str) -> int:
        self._counters[key] = self._counters.get(key, 0) + 1
        return self._counters[key]

    def _op_delete(self, prefix: str) -> None:
        for k in [k for k in self._data if k.startswith(prefix)]:
            del self._data[k]

    def _op_add(self, key: str, amount: int) -> int:
        value = int(self._data.get(key, b"0")) + int(amount)
        self._data[key] = str(value).encode()
        self._cond.notify_all()
        return value

    def _op_cas(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self._data.get(key)
        if (current is None and not expected) or (current is not None and current == expected):
            self._data[key] = bytes(desired)
            self._cond.notify_all()
            return bytes(desired)
        return expected if current is None else current

    def _op_wait(self, keys: Sequence[str], timeout_s: float) -> list[str]:
        self._wait_for(keys, timeout_s)
        return [k for k in keys if k not in self._data]

    def _op_check(self, keys: Sequence[str]) -> bool:
        return all(k in self._data for k in keys)

    def _op_delete_key(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def _op_count(self, prefix: str) -> int:
        return sum(1 for k in self._data if k.startswith(prefix))


class KVStoreServer:
    """A thread-based key-value service for a job's rendezvous (the operations: ``KVTable``).

    ``listener_options`` go to the ``Listener`` (``max_pending``, ``handshake_timeout_s``); ``encrypt``: every
    connection's frames are encrypted (``wire``; its clients must say so too).
    """

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *, encrypt: bool = False,
                 **listener_options: Any) -> None:
        self.secret = secret
        self.encrypt = encrypt
        self._listener_options = listener_options
        self._bind = (host, port)
        self.table = KVTable()
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self.address: tuple[str, int] | None = None
        self._bad_frames = 0

    @property
    def rejected(self) -> int:
        """Connections dropped because they failed the handshake or a frame failed its check."""
        return (self._listener.rejected if self._listener is not None else 0) + self._bad_frames

    def start(self) -> tuple[str, int]:
        """Bind, start serving in a daemon thread, and return ``(host, port)`` for clients."""
        if self.address is not None:
            return self.address
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(self._bind)
        sock.listen(256)
        host, port = sock.getsockname()[:2]
        if host in ("0.0.0.0", ""):
            host = routable_address()
        self.address = (host, port)
        self._listener = Listener(sock, self.secret, self._serve, name="spark-hvd-kv", encrypt=self.encrypt,
                                  **self._listener_options)
        self._listener.start()
        logger.debug("KV rendezvous service listening on %s:%d", host, port)
        return self.address

    def stop(self) -> None:
        """Stop serving and close every connection. Safe to call twice."""
        self.table.stop()
        if self._listener is not None:
            self._listener.stop()

    def __enter__(self) -> KVStoreServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- server side -------------------------------------------------------------------------------------------
    def _serve(self, framed: FramedSocket, peer: str) -> None:
        """One authenticated client: answer its requests until it goes away (runs on the connection's thread)."""
        framed.peer = f"KV client {peer}"
        framed.sock.settimeout(None)
        try:
            self.table.serve(framed)
        except AuthenticationError:
            with self._lock:
                self._bad_frames += 1
            logger.warning("KV service: dropped the connection from %s (a frame failed its check)", peer)


class KVClient:
    """A connection to a ``KVStoreServer`` (not thread-safe: one per thread).

    ``hello``: a first frame sent after the handshake, for a service that serves KV requests beside others (the
    Spark runner's driver service wants ``("hello", job_id, rank, "kv")``). ``encrypt``: as the service does.
    """

    def __init__(self, address: str | tuple[str, int], secret: bytes, timeout_s: float = 30.0,
                 hello: tuple[Any, ...] | None = None, encrypt: bool = False) -> None:
        host, port = parse_address(address) if isinstance(address, str) else address
        self.address = f"{host}:{port}"
        self.encrypt = encrypt
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:  # the service may still be starting, or busy: retry until the timeout
            try:
                self._sock = self._connect(host, port, secret, max(0.1, deadline - time.monotonic()))
                if hello is not None:
                    self._sock.send_object(hello)
                return
            except (OSError, PeerFailureError) as exc:  # not AuthenticationError: a wrong secret stays wrong
                if time.monotonic() + delay > deadline:
                    raise PeerFailureError(
                        f"could not reach the rendezvous service at {self.address} within {timeout_s:.0f}s: {exc}",
                        operation="rendezvous") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _connect(self, host: str, port: int, secret: bytes, timeout_s: float) -> FramedSocket:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        framed = FramedSocket(sock, secret, f"rendezvous service {self.address}", self.encrypt)
        try:
            framed.handshake("client", timeout_s)
        except BaseException:
            framed.close()
            raise
        sock.settimeout(None)
        return framed

    def _call(self, *request: Any) -> Any:
        self._sock.send_object(request)
        reply = self._sock.recv_object(MAX_KV_FRAME)
        if reply[0] != "ok":
            raise SparkHvdError(f"rendezvous service {self.address} refused {request[0]!r}: {reply[1]}")
        return reply[1] if len(reply) > 1 else None

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites)."""
        self._call("set", key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` for it to be set (``CollectiveTimeoutError`` after)."""
        found = self.get_many([key], timeout_s)
        if key not in found:
            raise CollectiveTimeoutError(f"key {key!r} was not set at {self.address} within {timeout_s:.0f}s",
                                         operation="rendezvous")
        return found[key]

    def get_many(self, keys: Sequence[str], timeout_s: float) -> dict[str, bytes]:
        """Wait until every key is set or ``timeout_s`` passes; return the keys that are set."""
        self._sock.sock.settimeout(timeout_s + 30.0)
        try:
            return self._call("get", list(keys), timeout_s)
        finally:
            self._sock.sock.settimeout(None)

    def incr(self, key: str) -> int:
        """Atomically add one to the counter ``key`` and return its new value (the first call returns 1)."""
        return self._call("incr", key)

    def delete(self, prefix: str) -> None:
        """Remove every key starting with ``prefix``."""
        self._call("delete", prefix)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer stored at ``key`` (0 when unset); the new value."""
        return self._call("add", key, int(amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is unset and ``expected`` is empty); the value
        after the call (torch's ``Store.compare_set``)."""
        return self._call("cas", key, bytes(expected), bytes(desired))

    def wait(self, keys: Sequence[str], timeout_s: float) -> list[str]:
        """Wait until every key is set or ``timeout_s`` passes; the keys still missing."""
        self._sock.sock.settimeout(timeout_s + 30.0)
        try:
            return self._call("wait", list(keys), timeout_s)
        finally:
            self._sock.sock.settimeout(None)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set, now."""
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it was set."""
        return self._call("delete_key", key)

    def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        return self._call("count", prefix)

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()


class KVRendezvous(Rendezvous):
    """``Rendezvous`` over a ``KVStoreServer`` at ``address`` ("host:port").

    Every ``exchange`` is a new round (a per-rank counter on the service numbers them), so a job that
    initialises twice with the same ``job_id`` never reads the previous round's values. ``encrypt``: as the service.
    ``hello``: as ``KVClient``'s (the Spark runner's ranks meet in their driver service's table).
    """

    def __init__(self, address: str, secret: bytes, job_id: str = "", timeout_s: float = 30.0,
                 encrypt: bool = False, hello: tuple[Any, ...] | None = None) -> None:
        self.address = address
        self.secret = secret
        self.encrypt = encrypt
        self.hello = hello
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.host = parse_address(address)[0]

    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        """Publish ``value`` for ``rank`` and return all ``size`` values; names the missing ranks on timeout."""
        client = KVClient(self.address, self.secret, self.timeout_s, hello=self.hello, encrypt=self.encrypt)
        try:
            prefix = f"{self.job_id}/rendezvous"
            round_no = client.incr(f"{prefix}/round/{rank}")
            keys = [f"{prefix}/{round_no}/{r}" for r in range(size)]
            client.set(keys[rank], value)
            found = client.get_many(keys, self.timeout_s)
        finally:
            client.close()
        missing = [r for r, k in enumerate(keys) if k not in found]
        if missing:
            raise CollectiveTimeoutError(
                f"rendezvous of job {self.job_id!r} at {self.address}: rank {rank} waited {self.timeout_s:.0f}s "
                f"but rank(s) {missing} of {size} never arrived; check that those processes started",
                rank=missing[0], operation="rendezvous")
        return [found[k] for k in keys]


class StaticRendezvous(Rendezvous):
    """A rendezvous whose answer is already known (every rank's value gathered elsewhere).

    ``values`` may be a list to return as is, or a callable ``(rank, size, value) -> list[bytes]``.
    """

    def __init__(self, values: Sequence[bytes] | Any) -> None:
        self._values = values

    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        if callable(self._values):
            return list(self._values(rank, size, value))
        values = list(self._values)
        if len(values) != size:
            raise ValueError(f"static rendezvous holds {len(values)} values for a job of size {size}")
        return values
