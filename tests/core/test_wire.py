"""The authenticated framing: handshake, control (HMAC) and data (GMAC) frames, tampering and replays."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from helpers.net import RecordingRelay

from spark_hvd.core.errors import AuthenticationError, PeerFailureError
from spark_hvd.core.transport.wire import HEADER_SIZE, MAGIC, NONCE_SIZE, PROOF_SIZE, FramedSocket, make_secret


def _handshaken(secret_a: bytes, secret_b: bytes) -> tuple[FramedSocket, FramedSocket, list[BaseException]]:
    """A connected pair; the handshake runs on both ends at once (a: client, b: server)."""
    raw_a, raw_b = socket.socketpair()
    a, b = FramedSocket(raw_a, secret_a, "a"), FramedSocket(raw_b, secret_b, "b")
    errors: list[BaseException] = []

    def side(framed: FramedSocket, role: str) -> None:
        try:
            framed.handshake(role, timeout_s=10)
        except Exception as exc:  # collected for the test to look at
            errors.append(exc)
            framed.sock.shutdown(socket.SHUT_RDWR)

    threads = [threading.Thread(target=side, args=(a, "client")), threading.Thread(target=side, args=(b, "server"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return a, b, errors


def _swap_in(framed: FramedSocket, raw: bytes) -> socket.socket:
    """Make ``framed`` read ``raw`` next (its keys and counters unchanged); returns the writing end."""
    writer, reader = socket.socketpair()
    framed.sock = reader
    writer.sendall(raw)
    return writer


def _take_frame(framed: FramedSocket, payload_size: int) -> bytes:
    """The raw bytes of one frame waiting on ``framed``'s socket."""
    raw = bytearray()
    while len(raw) < HEADER_SIZE + payload_size:
        raw += framed.sock.recv(HEADER_SIZE + payload_size - len(raw))
    return bytes(raw)


def test_objects_and_data_round_trip_after_the_handshake():
    secret = make_secret()
    a, b, errors = _handshaken(secret, secret)
    assert errors == [] and a.authenticated and b.authenticated
    a.send_object({"x": [1, 2, 3]})
    a.send_bytes(b"abc", memoryview(b"def"))
    assert b.recv_object() == {"x": [1, 2, 3]}
    assert b.recv_bytes() == b"abcdef"
    data = np.random.default_rng().random(300_000)  # above the single-write threshold
    got = np.empty_like(data)
    reader = threading.Thread(target=a.recv_into, args=(memoryview(got).cast("B"), True))
    reader.start()
    b.send_bytes(memoryview(data).cast("B"), fast=True)
    reader.join(20)
    np.testing.assert_array_equal(got, data)


def test_lazy_handshake_first_sender_is_the_client():
    secret = make_secret()
    raw_a, raw_b = socket.socketpair()
    a, b = FramedSocket(raw_a, secret, "a"), FramedSocket(raw_b, secret, "b")
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(b.recv_object()))
    reader.start()
    a.send_object(("hello", 1))
    reader.join(20)
    assert got == [("hello", 1)]


def test_wrong_secret_fails_the_handshake_on_both_ends():
    a, b, errors = _handshaken(make_secret(), make_secret())
    assert any(isinstance(e, AuthenticationError) for e in errors)
    assert not b.authenticated  # nothing can be read (or unpickled) from a


def test_tampered_data_frame_is_rejected():
    secret = make_secret()
    a, b, _ = _handshaken(secret, secret)
    payload = np.arange(1000, dtype=np.float32)
    a.send_bytes(memoryview(payload).cast("B"), fast=True)
    raw = bytearray(_take_frame(b, payload.nbytes))
    raw[HEADER_SIZE + 123] ^= 0x01  # one flipped bit in the payload
    writer = _swap_in(b, bytes(raw))
    with pytest.raises(AuthenticationError):
        b.recv_into(memoryview(np.empty_like(payload)).cast("B"), fast=True)
    writer.close()


@pytest.mark.parametrize("fast", [False, True], ids=["control", "data"])
def test_mac_kind_cannot_be_swapped(fast):
    # a frame tagged as one kind never verifies as the other
    secret = make_secret()
    a, b, _ = _handshaken(secret, secret)
    a.send_bytes(b"x" * 64, fast=fast)
    with pytest.raises(AuthenticationError):
        b.recv_into(memoryview(bytearray(64)), fast=not fast)


def test_frame_replayed_within_a_connection_is_rejected():
    secret = make_secret()
    a, b, _ = _handshaken(secret, secret)
    a.send_bytes(b"once")
    raw = _take_frame(b, 4)
    writer = _swap_in(b, raw + raw)
    assert b.recv_bytes() == b"once"
    with pytest.raises(AuthenticationError):
        b.recv_bytes()
    writer.close()


def test_recorded_connection_replayed_fails_the_handshake():
    secret = make_secret()
    # client <-> relay <-> server, the relay recording what the client sent
    listener = socket.create_server(("127.0.0.1", 0))
    relay = RecordingRelay(listener.getsockname()[:2])
    host, port = relay.address.rsplit(":", 1)
    client_end = socket.create_connection((host, int(port)), timeout=20)
    server_end, _ = listener.accept()
    client, server = FramedSocket(client_end, secret, "client"), FramedSocket(server_end, secret, "server")
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(server.recv_bytes()))
    thread.start()
    client.send_bytes(b"set k v1")
    thread.join(20)
    assert got == [b"set k v1"]
    assert len(relay.recorded) == len(MAGIC) + NONCE_SIZE + PROOF_SIZE + HEADER_SIZE + 8
    # the same bytes on a new connection: the server's fresh nonce makes the recorded proof wrong
    attacker, victim_end = socket.socketpair()
    victim = FramedSocket(victim_end, secret, "server")
    attacker.sendall(bytes(relay.recorded))
    with pytest.raises(AuthenticationError):
        victim.handshake("server", timeout_s=10)
    for sock in (client_end, server_end, attacker, victim_end, listener):
        sock.close()
    relay.close()


def test_silent_peer_times_out_in_the_handshake():
    a, b = socket.socketpair()
    with pytest.raises(PeerFailureError):
        FramedSocket(b, make_secret(), "silent").handshake("server", timeout_s=0.3)
    a.close()
    b.close()


def test_data_frame_split_the_receiver_cannot_see_is_refused():
    # a data frame's tag depends on how it is split (type byte | payload): other splits are refused before
    # anything is sent, and the frame counter stays in step for the next frame
    secret = make_secret()
    a, b, _ = _handshaken(secret, secret)
    with pytest.raises(ValueError, match="one payload"):
        a.send_bytes(b"ab", b"payload", fast=True)
    a.send_bytes(b"payload", fast=True)
    got = bytearray(7)
    b.recv_into(memoryview(got), fast=True)
    assert got == b"payload"
