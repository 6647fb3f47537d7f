"""Listeners that survive their clients, tried as an attacker would (the KV service as the example listener)."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers.net import closed_by_server

from spark_hvd.core.errors import PeerFailureError
from spark_hvd.core.transport.rendezvous import KVClient, KVStoreServer
from spark_hvd.core.transport.wire import MAGIC, make_secret


def _conn_threads(before: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "spark-hvd-kv-conn" and t not in before]


_SERVER = textwrap.dedent("""
    import os, resource, sys
    from spark_hvd.core.transport.rendezvous import KVStoreServer
    srv = KVStoreServer(bytes.fromhex(sys.argv[1]), handshake_timeout_s=1.0)
    host, port = srv.start()
    limit = len(os.listdir("/proc/self/fd")) + 12   # room for a few connections only
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(port, flush=True)
    sys.stdin.readline()
    print(srv._listener.accept_errors, srv.rejected, flush=True)
    srv.stop()
""")


@pytest.mark.slow
def test_idle_connections_and_no_file_descriptors_left_then_a_client_succeeds():
    secret = make_secret()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, secret.hex()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    idle: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        # many idle connections: the server runs out of descriptors (EMFILE in accept) and must carry on
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        client = KVClient(("127.0.0.1", port), secret, timeout_s=60)
        client.set("k", b"v")
        assert client.get("k", 5) == b"v"
        client.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        accept_errors, rejected = map(int, proc.stdout.readline().split())
        assert accept_errors > 0, "the test did not exhaust the server's descriptors"
        assert rejected > 0
    finally:
        for sock in idle:
            sock.close()
        proc.kill()
        proc.wait(10)


def test_slow_loris_does_not_hold_the_service():
    secret = make_secret()
    before = frozenset(_conn_threads())
    with KVStoreServer(secret, handshake_timeout_s=1.0) as server:
        assert server.address is not None
        loris = socket.create_connection(server.address)
        loris.sendall(MAGIC + b"0123")  # a started hello, then silence
        huge = socket.create_connection(server.address)
        huge.sendall(b"\0\0\0\x01\0\0\0\0" * 5)  # claims a 1 TiB frame: not a hello, nothing allocated
        client = KVClient(server.address, secret)  # served while both are connected
        client.set("k", b"v")
        assert client.get("k", 5) == b"v"
        assert closed_by_server(huge)
        assert closed_by_server(loris)  # dropped after the handshake timeout
        client.close()
        deadline = time.monotonic() + 10
        while _conn_threads(before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _conn_threads(before) == []  # every connection's thread ended with it
        assert server.rejected == 2
        loris.close()
        huge.close()


def test_unauthenticated_connections_are_capped():
    secret = make_secret()
    with KVStoreServer(secret, max_pending=4, handshake_timeout_s=30.0) as server:
        assert server.address is not None
        idle = [socket.create_connection(server.address) for _ in range(10)]
        open_ = set(idle)
        deadline = time.monotonic() + 20
        while len(open_) > 4 and time.monotonic() < deadline:
            for sock in select.select(list(open_), [], [], 0.2)[0]:
                if closed_by_server(sock, timeout_s=1.0):
                    open_.discard(sock)
        time.sleep(0.3)
        assert not select.select(list(open_), [], [], 0)[0]
        assert len(open_) == 4  # over the cap: closed on arrival; 4 wait for their handshake
        # while the 4 hold every slot a new client is refused rather than queued forever
        with pytest.raises(PeerFailureError):
            KVClient(server.address, secret, timeout_s=2)
        for sock in idle:
            sock.close()
        client = KVClient(server.address, secret, timeout_s=30)
        client.set("k", b"v")
        client.close()
