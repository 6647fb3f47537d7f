"""Network helpers of the tests: a free port, a recording TCP relay (for replay attacks), polling for a condition."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """``predicate()`` became true within ``timeout_s`` (e.g. a listener counting a refused connection on its own
    thread)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def closed_by_server(sock: socket.socket, timeout_s: float = 30.0) -> bool:
    """Read until the server closes ``sock`` (True) or ``timeout_s`` pass (False); what it sent before (its hello)
    is ignored."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
    """Copy ``src`` to ``dst`` (recording into ``record``) until ``src`` ends; then both are shut down, so the end
    of one side reaches the other."""
    try:
        while chunk := src.recv(65536):
            if record is not None:
                record += chunk
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RecordingRelay:
    """A man in the middle on 127.0.0.1: the first connection to ``address`` is forwarded to ``upstream`` (host,
    port) both ways, and what the client sent is kept in ``recorded`` (to replay it on a connection of its own)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.recorded = bytearray()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.host_port: tuple[str, int] = ("127.0.0.1", self._server.getsockname()[1])
        self.address = f"127.0.0.1:{self.host_port[1]}"
        threading.Thread(target=self._run, name="recording-relay", daemon=True).start()

    def _run(self) -> None:
        try:
            client, _ = self._server.accept()
        except OSError:  # closed before anyone connected
            return
        self._server.close()
        upstream = socket.create_connection(self.upstream)
        threading.Thread(target=_pump, args=(client, upstream, self.recorded), daemon=True).start()
        _pump(upstream, client, None)

    def close(self) -> None:
        self._server.close()
