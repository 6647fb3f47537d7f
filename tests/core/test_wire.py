import socket

import pytest

from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.wire import FramedSocket, make_secret


def _pair(secret_a: bytes, secret_b: bytes):
    a, b = socket.socketpair()
    return FramedSocket(a, secret_a, "a"), FramedSocket(b, secret_b, "b")


def test_objects_round_trip():
    secret = make_secret()
    a, b = _pair(secret, secret)
    a.send_object({"x": [1, 2, 3]})
    a.send_bytes(b"abc", memoryview(b"def"))
    assert b.recv_object() == {"x": [1, 2, 3]}
    assert b.recv_bytes() == b"abcdef"


def test_wrong_secret_is_rejected_before_unpickling():
    a, b = _pair(make_secret(), make_secret())

    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled a forged frame",))

    a.send_object(Boom())
    with pytest.raises(AuthenticationError):
        b.recv_object()


def test_replayed_frame_is_rejected():
    secret = make_secret()
    raw_a, raw_b = socket.socketpair()
    sender = FramedSocket(raw_a, secret, "a")
    receiver = FramedSocket(raw_b, secret, "b")
    sender.send_bytes(b"once")
    assert receiver.recv_bytes() == b"once"
    replay = FramedSocket(raw_a, secret, "a")  # a fresh counter: as if the first frame were sent again
    replay.send_bytes(b"once")
    with pytest.raises(AuthenticationError):
        receiver.recv_bytes()
