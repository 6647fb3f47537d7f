"""KV rendezvous service, its client and the shared reductions (single process, threads as ranks)."""

from __future__ import annotations

import pickle
import socket
import struct
import threading

import numpy as np
import pytest
from helpers.net import RecordingRelay, closed_by_server, free_port, wait_until

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import AuthenticationError, CollectiveTimeoutError, PeerFailureError
from spark_hvd.core.reduce import ELEMENTWISE_OPS, bf16_to_f32, divide_average, f32_to_bf16, reduce_into, scale_inplace
from spark_hvd.core.transport.rendezvous import KVClient, KVRendezvous, KVTable, parse_address
from spark_hvd.core.transport.wire import FramedSocket, make_secret


def test_set_get_and_wait(kv_server):
    srv, address, secret = kv_server
    a = KVClient(address, secret)
    b = KVClient(address, secret)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(b.get("k", timeout_s=60)))
    t.start()
    a.set("k", b"value")
    t.join(60)
    assert got == [b"value"]
    assert a.incr("c") == 1 and b.incr("c") == 2
    with pytest.raises(CollectiveTimeoutError):
        a.get("never", timeout_s=0.2)
    a.delete("k")
    assert a.get_many(["k"], timeout_s=0) == {}
    a.close()
    b.close()


def test_torch_store_operations_on_the_table(kv_server):
    _, address, secret = kv_server
    a = KVClient(address, secret)
    assert [a.add("n", 5), a.add("n", -2)] == [5, 3] and a.get("n", 1) == b"3"  # a decimal, as torch stores it
    assert a.compare_set("c", b"", b"v1") == b"v1" and a.compare_set("c", b"no", b"v2") == b"v1"
    assert a.wait(["c", "missing"], 0.1) == ["missing"] and a.check(["c"]) and not a.check(["missing"])
    assert a.count("") == 2 and a.delete_key("c") and not a.delete_key("c") and a.count("") == 1
    a.close()
    table = KVTable()  # an authenticated but confused client gets an error answer, the service goes on
    assert table.apply(("nope",))[0] == "error" and table.apply(("set", "k"))[0] == "error"
    assert table.apply(["set", "k", b"v"])[0] == "error" and table.apply(("add", "k", "x"))[0] == "error"
    assert table.apply(("set", "k", b"v")) == ("ok", None) and table.apply(("add", "k", 1))[0] == "error"


@pytest.mark.parametrize("size", [1, 3])
def test_exchange_threads(kv_server, size):
    _, address, secret = kv_server
    results: dict[int, list[bytes]] = {}

    def rank_main(rank: int) -> None:
        rdzv = KVRendezvous(address, secret, job_id="j1", timeout_s=60)
        results[rank] = rdzv.exchange(rank, size, f"addr-{rank}".encode())
        # a second exchange is a new round and never sees the first round's values
        results[rank + 100] = rdzv.exchange(rank, size, f"second-{rank}".encode())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(size):
        assert results[r] == [f"addr-{i}".encode() for i in range(size)]
        assert results[r + 100] == [f"second-{i}".encode() for i in range(size)]


def test_exchange_timeout_names_missing_ranks(kv_server):
    _, address, secret = kv_server
    rdzv = KVRendezvous(address, secret, job_id="j2", timeout_s=0.5)
    with pytest.raises(CollectiveTimeoutError) as info:
        rdzv.exchange(1, 4, b"x")
    assert "[0, 2, 3]" in str(info.value)
    assert info.value.rank == 0 and info.value.operation == "rendezvous"


def test_forged_client_is_dropped_never_unpickled(kv_server):
    srv, address, secret = kv_server
    unpickled = []

    class Boom:
        def __reduce__(self):
            return (unpickled.append, ("forged frame was unpickled",))

    host, port = parse_address(address)
    # a client without the secret fails the handshake: it never gets to send a frame
    forged = FramedSocket(socket.create_connection((host, port), timeout=30), make_secret(), "attacker")
    with pytest.raises(AuthenticationError):
        forged.send_object(("set", "k", Boom()))
    forged.close()
    # raw bytes claiming a huge frame: not a handshake, dropped after reading the fixed-size hello
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(struct.pack("!Q", 1 << 40) + b"\0" * 64)
    assert closed_by_server(sock)
    sock.close()
    assert unpickled == [] and wait_until(lambda: srv.rejected == 2)
    # the service still serves honest clients
    client = KVClient(address, secret)
    client.set("ok", pickle.dumps(1))
    assert client.get("ok", 5) == pickle.dumps(1)
    client.close()


def test_replayed_connection_does_not_revert_a_value(kv_server):
    srv, address, secret = kv_server
    target = parse_address(address)
    relay = RecordingRelay(target)
    recorded = relay.recorded
    legit = KVClient(relay.host_port, secret)
    legit.set("k", b"old")
    legit.close()
    honest = KVClient(address, secret)
    honest.set("k", b"new")
    # an attacker replays the recorded connection (hello, proof, the 'set k old' frame) on a new connection
    assert len(recorded) > 0
    sock = socket.create_connection(target, timeout=30)
    sock.sendall(bytes(recorded))
    assert closed_by_server(sock)
    sock.close()
    assert wait_until(lambda: srv.rejected == 1)
    assert honest.get("k", 5) == b"new"
    honest.close()


def test_unreachable_service_raises():
    with pytest.raises(PeerFailureError):
        KVClient(f"127.0.0.1:{free_port()}", make_secret(), timeout_s=0.3)


@pytest.mark.parametrize("op", ELEMENTWISE_OPS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8])
def test_reduce_into(op, dtype):
    rng = np.random.default_rng()
    a = (rng.random(257) * 10 + 1).astype(dtype)
    b = (rng.random(257) * 10 + 1).astype(dtype)
    expected = {ReduceOp.SUM: a + b, ReduceOp.AVERAGE: a + b, ReduceOp.MIN: np.minimum(a, b),
                ReduceOp.MAX: np.maximum(a, b), ReduceOp.PRODUCT: a * b}[op]
    acc = a.copy()
    reduce_into(acc, b, op)
    np.testing.assert_array_equal(acc, expected)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Reference nearest-even rounding of float32 to bfloat16 bits, element by element in Python ints."""
    out = []
    for v in x.astype(np.float32).view(np.uint32).tolist():
        if (v & 0x7F800000) == 0x7F800000 and v & 0x7FFFFF:
            out.append(((v >> 16) & 0x8000) | 0x7FC0)
            continue
        upper, lower = v >> 16, v & 0xFFFF
        if lower > 0x8000 or (lower == 0x8000 and upper & 1):
            upper += 1
        out.append(upper & 0xFFFF)
    return np.array(out, dtype=np.uint16)


def test_bfloat16_round_trip_and_reduce():
    rng = np.random.default_rng()
    x = (rng.standard_normal(1000) * 100).astype(np.float32)
    x[:4] = [np.nan, np.inf, -np.inf, 0.0]
    # ties: exact halfway values round to even
    x[4:8] = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0xBF818000], dtype=np.uint32).view(np.float32)
    bits = f32_to_bf16(x.copy(), np.empty(x.shape, np.uint16))
    np.testing.assert_array_equal(bits, _bf16_round(x))
    back = bf16_to_f32(bits)
    assert np.isnan(back[0]) and back[1] == np.inf and back[2] == -np.inf
    a = _bf16_round(rng.standard_normal(333).astype(np.float32))
    b = _bf16_round(rng.standard_normal(333).astype(np.float32))
    acc = a.copy()
    reduce_into(acc, b, ReduceOp.SUM, bfloat16=True)
    np.testing.assert_array_equal(acc, _bf16_round(bf16_to_f32(a) + bf16_to_f32(b)))
    divide_average(acc, 2, bfloat16=True)
    scale_inplace(acc, 2.0, bfloat16=True)
    ints = np.array([-7, 7, 9], dtype=np.int32)
    divide_average(ints, 2)
    np.testing.assert_array_equal(ints, [-3, 3, 4])
