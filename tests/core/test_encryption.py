"""Encryption in transit (``SPARK_HVD_ENCRYPT``, ``JobEnv.encrypt``): encrypted rings equal numpy in both loops,
ends that disagree fail fast and say who encrypts, and a frame's plaintext never reaches the wire (a recording
relay between two ranks finds a known gradient pattern in clear without encryption, and nowhere with it)."""

from __future__ import annotations

import functools
import json
import socket
import sys
import textwrap

import numpy as np
import pytest
from helpers.net import RecordingRelay
from helpers.ranks import on_threads, run_ranks

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends.ring import even_bounds
from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.jobenv import JobEnv, encrypt_requested
from spark_hvd.core.reduce import divide_average, reduce_into
from spark_hvd.core.transport import ringloop
from spark_hvd.core.transport.tcp import PeerSocket, RingExchange
from spark_hvd.core.transport.wire import HEADER_SIZE, FramedSocket, check_encryption, make_secret

needs_compiled_loop = pytest.mark.skipif(ringloop._ringloop is None,
                                         reason="the compiled ring loop is not built here (`make setup`)")


def _ring_backend(**backend_kwargs):
    """A ``RingBackend`` from the environment ``run_ranks`` set, with the launch contract (its ``encrypt``)."""
    from spark_hvd.core.backends.ring import RingBackend
    from spark_hvd.core.settings import Settings
    from spark_hvd.core.transport.rendezvous import KVRendezvous

    settings = Settings.from_env()
    job = JobEnv.from_env()
    rdzv = KVRendezvous(job.rendezvous, job.secret, job.job_id, settings.timeout_s)  # run_ranks' service: clear
    return RingBackend(job.rank, job.size, rdzv, job.secret, settings, job.job_id, job=job, **backend_kwargs)


def _rank_data(seed: int, rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count])
    return rng.integers(-1000, 1000, count).astype(dtype) if dtype == "int64" else \
        rng.standard_normal(count).astype(dtype)


def _encrypted_collectives(seed: int) -> dict:
    """Allreduces on the ring (small frames: several per chunk) and an allgather, each against numpy."""
    be = _ring_backend(frame_bytes=64 * 1024, pair_exchange_bytes=16 * 1024)
    try:
        assert be.encrypt and all(peer.encrypt for peer in be.peers.values())
        for dtype, op, count in (("float32", ReduceOp.SUM, 200_003), ("float64", ReduceOp.AVERAGE, 100_001),
                                 ("int64", ReduceOp.SUM, 50_001), ("float16", ReduceOp.SUM, 30_001)):
            buf = _rank_data(seed, be.rank, count, dtype)
            be.allreduce(buf, op)
            parts = [_rank_data(seed, k, count, dtype).astype("float64") for k in range(be.size)]
            want = sum(parts) / (be.size if op is ReduceOp.AVERAGE else 1)
            tolerance = {"float16": 2e-2, "float32": 1e-5}.get(dtype, 1e-12)
            np.testing.assert_allclose(buf, want, rtol=tolerance, atol=tolerance, err_msg=f"{dtype} {op}")
        rows = be.allgather(_rank_data(seed, be.rank, (be.rank + 1) * 3000, "float32").reshape(-1, 3))
        np.testing.assert_array_equal(rows, np.concatenate(
            [_rank_data(seed, k, (k + 1) * 3000, "float32").reshape(-1, 3) for k in range(be.size)]))
        return {"compiled": be._compiled, "transport": be.transport}
    finally:
        be.close()


@pytest.mark.parametrize("loop, n", [("compiled", 2), ("python", 2), ("compiled", 3)])
def test_encrypted_ring_matches_numpy(loop, n):
    # the compiled loop and the Python loop, two ranks; the compiled loop, three
    if loop == "compiled" and ringloop._ringloop is None:
        pytest.skip("the compiled ring loop is not built here")
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    env = {"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60", "SPARK_HVD_ENCRYPT": "1",
           "SPARK_HVD_COMPILED_RING": "1" if loop == "compiled" else "0"}
    results = run_ranks(_encrypted_collectives, n, env=env, timeout=180, args=(seed,))
    assert results == [{"compiled": loop == "compiled", "transport": "tcp"}] * n


def _join_and_report() -> str:
    try:
        _ring_backend().close()
    except AuthenticationError as exc:
        return str(exc)
    return "joined"


def test_ranks_that_disagree_fail_before_connecting_and_name_the_odd_rank():
    # rank 1 encrypts, rank 0 does not: both fail at the rendezvous (no timeout), each naming itself and rank 1
    results = run_ranks(_join_and_report, 2, env=lambda rank: {"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60",
                                                              "SPARK_HVD_ENCRYPT": "1" if rank == 1 else "0"},
                        timeout=60)
    assert results[1].startswith("rank 1: encryption in transit is on here but off on rank(s) [0]; rank(s) [1] "
                                 "are at odds with the rest")
    assert results[0].startswith("rank 0: encryption in transit is off here but on on rank(s) [1]; rank(s) [1] are "
                                 "at odds")
    with pytest.raises(AuthenticationError, match=r"rank\(s\) \[0\] are at odds"):
        check_encryption(2, [True, False, False])  # rank 0 alone encrypts: it is named
    check_encryption(0, [True, True])


@pytest.mark.parametrize("client_encrypts", [True, False])
def test_a_handshake_between_ends_that_disagree_fails_on_both_saying_which_encrypts(client_encrypts):
    secret = make_secret()
    raw_a, raw_b = socket.socketpair()
    a, b = FramedSocket(raw_a, secret, "rank 1", client_encrypts), FramedSocket(raw_b, secret, "driver",
                                                                                not client_encrypts)
    errors: dict[str, BaseException] = {}

    def side(framed: FramedSocket, role: str) -> None:
        try:
            framed.handshake(role, timeout_s=10)
        except Exception as exc:  # collected for the assertions
            errors[role] = exc

    on_threads(2, lambda k: side(*((a, "client"), (b, "server"))[k]))
    assert set(errors) == {"client", "server"} and not a.authenticated and not b.authenticated
    encrypting, plain = ("client", "server") if client_encrypts else ("server", "client")
    assert isinstance(errors[encrypting], AuthenticationError)
    assert "does not encrypt its frames and this process does (SPARK_HVD_ENCRYPT" in str(errors[encrypting])
    assert "encrypts its frames and this process does not" in str(errors[plain])
    raw_a.close()
    raw_b.close()


def _tampered_stream(frames: list[np.ndarray], flip_at: int) -> tuple[PeerSocket, list[socket.socket]]:
    """A receiving ``PeerSocket`` (encrypted) whose socket holds ``frames`` as sent by its peer, one bit flipped at
    byte ``flip_at`` of the stream."""
    secret = make_secret()
    a, b = socket.socketpair()
    sender, receiver = PeerSocket(a, secret, 1, 30, True), PeerSocket(b, secret, 0, 30, True)
    on_threads(2, lambda k: sender.handshake("client", 10) if k == 0 else receiver.handshake("server", 10))
    for frame in frames:
        sender.send_data([memoryview(frame).cast("B")], "test")
    raw = bytearray(sum(HEADER_SIZE + 1 + f.nbytes for f in frames))
    view = memoryview(raw)
    while view.nbytes:
        view = view[b.recv_into(view):]
    raw[flip_at] ^= 0x01
    writer, reader = socket.socketpair()
    reader.settimeout(30)
    writer.sendall(bytes(raw))
    receiver.sock = reader
    return receiver, [a, b, writer, reader]


@pytest.mark.parametrize("loop", ["python", pytest.param("compiled-libcrypto", marks=needs_compiled_loop),
                                  pytest.param("compiled-cryptography", marks=needs_compiled_loop)])
def test_a_tampered_encrypted_frame_is_refused_before_it_is_reduced(monkeypatch, loop):
    # three encrypted frames, one bit of the second one's ciphertext flipped: the first is reduced into place, the
    # second raises AuthenticationError naming the peer, and neither it nor the third is reduced
    monkeypatch.setattr(ringloop, "MAC_MODE", 1 if loop.endswith("libcrypto") else 2)
    frames = [_rank_data(3, k, 2048, "float32") for k in range(3)]
    receiver, sockets = _tampered_stream(frames, 2 * (HEADER_SIZE + 1) + frames[0].nbytes + 100)
    flat = _rank_data(4, 0, 3 * 2048, "float32")
    before = flat.copy()
    plan = [(0, k * 8192, (k + 1) * 8192) for k in range(3)]
    try:
        with pytest.raises(AuthenticationError, match="rank 0"):
            if loop == "python":
                scratch = memoryview(np.empty(8192, np.uint8))

                def received(i: int) -> None:
                    reduce_into(flat[i * 2048:(i + 1) * 2048], np.frombuffer(scratch, np.float32), ReduceOp.SUM)

                RingExchange(receiver, receiver, "test").run([], [scratch] * 3, received)
            else:
                ringloop.run(receiver, receiver, "test", flat, np.empty(8192, np.uint8), [], plan, 1, 1,
                             ReduceOp.SUM, 2)
        np.testing.assert_array_equal(flat[:2048], before[:2048] + frames[0])
        np.testing.assert_array_equal(flat[2048:], before[2048:])
        assert receiver.recv_broken
    finally:
        for sock in sockets:
            sock.close()


def test_sealing_without_encrypt_into_gives_the_same_frames():
    # cryptography before encrypt_into / decrypt_into (the supported floor has neither): the copying fallback seals
    # and opens the same frames; a wrong tag is refused either way
    from spark_hvd.core.transport.wire import TAG_SIZE, _Direction

    key, payload = make_secret(), _rank_data(5, 0, 5000, "float32")
    into, copying = _Direction(key, True), _Direction(key, True)
    into._cipher()
    copying._cipher()
    copying._into = False
    sealed = into.seal(7, payload.nbytes + 1, b"\x00", memoryview(payload).cast("B"))
    assert sealed == copying.seal(7, payload.nbytes + 1, b"\x00", memoryview(payload).cast("B"))
    nonce, aad = bytes(4) + (7).to_bytes(8, "big"), (payload.nbytes + 1).to_bytes(8, "big") + b"\x00"
    for direction in (into, copying):  # the compiled loop's way in: the same bytes into its staging buffer
        out = bytearray(len(sealed))
        direction.seal_into(nonce, aad, memoryview(payload).cast("B"), memoryview(out))
        assert bytes(out) == sealed
    for direction in (into, copying):
        body = bytearray(sealed[:-TAG_SIZE])
        assert direction.open(7, payload.nbytes + 1, b"\x00", memoryview(body), sealed[-TAG_SIZE:])
        assert bytes(body) == payload.tobytes()
        assert not direction.open(8, payload.nbytes + 1, b"\x00", memoryview(bytearray(sealed[:-TAG_SIZE])),
                                  sealed[-TAG_SIZE:])  # another counter: another nonce


def test_the_launch_contract_carries_the_setting():
    job = JobEnv(rank=0, size=2, encrypt=True)
    assert job.to_env()["SPARK_HVD_ENCRYPT"] == "1" and JobEnv.from_env(job.to_env()).encrypt
    assert not JobEnv.from_env({**job.to_env(), "SPARK_HVD_ENCRYPT": "0"}).encrypt
    assert not JobEnv.from_env({"SPARK_HVD_RANK": "0", "SPARK_HVD_SIZE": "2"}).encrypt
    assert encrypt_requested({"SPARK_HVD_ENCRYPT": "true"}) and not encrypt_requested({})


# -- what reaches the wire --------------------------------------------------------------------------------------------
def _gradient(count: int) -> np.ndarray:
    """A recognisable float32 'gradient': no 16-byte run of it is likely in ciphertext by chance."""
    return (np.arange(count, dtype=np.float32) * np.float32(1e-3) + np.float32(0.5)).astype(np.float32)


def _relayed_pair(encrypt: bool) -> tuple[PeerSocket, PeerSocket, RecordingRelay, list[socket.socket]]:
    """Rank 1 -> relay -> rank 0 over loopback TCP, handshaken; the relay records what rank 1 sends."""
    secret = make_secret()
    listener = socket.create_server(("127.0.0.1", 0))
    relay = RecordingRelay(listener.getsockname()[:2])
    dialed = socket.create_connection(relay.host_port, timeout=20)
    accepted = listener.accept()[0]
    rank1, rank0 = PeerSocket(dialed, secret, 0, 30, encrypt), PeerSocket(accepted, secret, 1, 30, encrypt)
    on_threads(2, lambda k: rank1.handshake("client", 10) if k == 0 else rank0.handshake("server", 10))
    return rank1, rank0, relay, [listener, dialed, accepted]


def _ring_plan(p: int, bounds: list[int], sub: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Two-rank allreduce (one reduce-scatter step, one allgather step) of ring position ``p``, in ``sub``-byte
    frames: its first frames and its receive plan (as ``RingBackend._ring`` makes them)."""

    def pieces(chunk: int) -> list[tuple[int, int]]:
        lo, hi = bounds[chunk], bounds[chunk + 1]
        return [(at, min(hi, at + sub)) for at in range(lo, hi, sub)]

    return pieces((p - 1) % 2), [(t, lo, hi) for t in range(2) for lo, hi in pieces((p - t - 2) % 2)]


def _python_allreduce(peer: PeerSocket, flat: np.ndarray, first, plan) -> None:
    raw = flat.view(np.uint8)
    scratch = memoryview(np.empty(max(hi - lo for _, lo, hi in plan), np.uint8))
    receives = [scratch[:hi - lo] if t < 1 else memoryview(raw[lo:hi]) for t, lo, hi in plan]

    def received(i: int) -> memoryview | None:
        t, lo, hi = plan[i]
        if t < 1:
            reduce_into(flat[lo // 4:hi // 4], np.frombuffer(receives[i], dtype=flat.dtype), ReduceOp.SUM)
            divide_average(flat[lo // 4:hi // 4], 2)
            return memoryview(raw[lo:hi])
        return None

    RingExchange(peer, peer, "test").run([memoryview(raw[lo:hi]) for lo, hi in first], receives, received)


@pytest.mark.parametrize("loop", ["python", pytest.param("compiled-libcrypto", marks=needs_compiled_loop),
                                  pytest.param("compiled-cryptography", marks=needs_compiled_loop)])
@pytest.mark.parametrize("encrypt", [False, True], ids=["authenticated", "encrypted"])
def test_a_frames_plaintext_never_reaches_the_wire(monkeypatch, loop, encrypt):
    # a two-rank AVERAGE allreduce of a known gradient (rank 1's) and its negation plus one (rank 0's), then a
    # control frame carrying a known marker: without encryption the relay sees 64-byte runs of rank 1's gradient
    # (the reduce-scatter step) and of the average (the allgather step) and the marker; with it, none of them
    # (the compiled loop seals and opens with libcrypto without the GIL, or with cryptography under it)
    monkeypatch.setattr(ringloop, "MAC_MODE", 1 if loop.endswith("libcrypto") else 2)
    count = 40_000  # 160 KiB: two chunks of 80 KiB, frames of 16 KiB
    gradient, other = _gradient(count), 1.0 - _gradient(count)
    rank1, rank0, relay, sockets = _relayed_pair(encrypt)
    try:
        flats = [other.copy(), gradient.copy()]
        bounds = [b * 4 for b in even_bounds(count, 2)]
        plans = [_ring_plan(p, bounds, 16 * 1024) for p in range(2)]
        peers = [rank0, rank1]
        if loop != "python":
            scratch = np.empty(16 * 1024, np.uint8)
            calls = [functools.partial(ringloop.run, peers[p], peers[p], "test", flats[p], scratch.copy(), *plans[p],
                                       1, 2, ReduceOp.AVERAGE, 2) for p in range(2)]
        else:
            calls = [functools.partial(_python_allreduce, peers[p], flats[p], *plans[p]) for p in range(2)]
        on_threads(2, lambda k: calls[k]())
        average = (other + gradient) / np.float32(2)
        for flat in flats:
            np.testing.assert_array_equal(flat, average)
        marker = b"a known control payload: " + bytes(range(48))
        rank1.send_data([marker], "test", b"\x02")
        assert rank0.recv_message("test", b"\x02") == marker  # so the relay recorded it (it forwards what it kept)
        wire = bytes(relay.recorded)
        assert len(wire) > count * 4 + len(marker)  # half of each array, twice, and the marker
        patterns = [gradient.tobytes()[at:at + 64] for at in range(0, count * 4, 4096)] + \
                   [average.tobytes()[at:at + 64] for at in range(0, count * 4, 4096)]
        found = [p for p in patterns if p in wire]
        if encrypt:
            assert found == [] and marker[:32] not in wire
        else:  # rank 1 sends half of its gradient (reduce-scatter) and half of the average (allgather) in clear
            assert len(found) >= len(patterns) // 2 - 2 and marker in wire
    finally:
        for sock in sockets:
            sock.close()
        relay.close()


def test_spark_hvd_run_encrypt_allreduces_over_encrypted_services(tmp_path):
    # run_local(encrypt=True), spark-hvd-run --encrypt's: the KV rendezvous, the driver service (report) and the
    # ring all encrypt, and the ranks' allreduce equals numpy
    from spark_hvd.runner.launch import build_parser, run_local

    assert build_parser().parse_args(["-np", "2", "--encrypt", "python", "x.py"]).encrypt is True
    assert build_parser().parse_args(["-np", "2", "python", "x.py"]).encrypt is None
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import json, os
        import numpy as np
        import spark_hvd.core as hvd
        from spark_hvd.core.backend import ReduceOp
        from spark_hvd.runner import report
        hvd.init()
        data = np.random.default_rng(7 + hvd.rank()).standard_normal(300_001)
        out = hvd.allreduce(data.copy(), op=ReduceOp.SUM)
        expected = sum(np.random.default_rng(7 + r).standard_normal(300_001) for r in range(hvd.size()))
        report(epoch=1, err=float(np.max(np.abs(out - expected))))
        print("RESULT " + json.dumps({"rank": hvd.rank(), "encrypt": os.environ["SPARK_HVD_ENCRYPT"],
                                      "err": float(np.max(np.abs(out - expected)))}))
        hvd.shutdown()
    """))
    events = []
    result = run_local([sys.executable, str(script)], 2, env={"SPARK_HVD_SHM": "0"}, timeout=120, capture=True,
                       encrypt=True, on_event=events.append)
    assert result.returncode == 0, "\n".join(result.stderr[-30:])
    found = {}
    for line in result.stdout:
        rank, _, text = line.partition(" ")
        if text.startswith("RESULT "):
            found[int(rank.strip("[]"))] = json.loads(text[len("RESULT "):])
    assert [found[r]["encrypt"] for r in (0, 1)] == ["1", "1"]
    assert all(found[r]["err"] < 1e-9 for r in (0, 1))
    assert sorted(e.rank for e in events) == [0, 1]  # the reports came through the encrypted driver service
