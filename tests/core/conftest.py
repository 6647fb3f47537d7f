"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from spark_hvd.core.transport.rendezvous import KVStoreServer
from spark_hvd.core.transport.wire import make_secret


@pytest.fixture
def kv_server():
    """A running ``KVStoreServer`` with a fresh secret: ``(server, "host:port", secret)``."""
    secret = make_secret()
    server = KVStoreServer(secret)
    host, port = server.start()
    yield server, f"{host}:{port}", secret
    server.stop()
