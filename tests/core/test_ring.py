"""RingBackend on N = 1..4 spawned ranks, shared-memory and TCP paths: every collective against numpy; the ring's
exchange loops (``tcp.RingExchange`` and the compiled ``ringloop``) on their own frames."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib
import os
import shutil
import signal
import socket
import struct
import sysconfig
import termios
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers.ranks import RankDied, backend_from_env, on_threads, run_ranks, shm_leftovers

from spark_hvd.core.algorithms import agreed, hier_pipeline
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends.ring import even_bounds
from spark_hvd.core.errors import AuthenticationError, CollectiveTimeoutError, PeerFailureError
from spark_hvd.core.reduce import ELEMENTWISE_OPS, bf16_to_f32, divide_average, f32_to_bf16, reduce_into
from spark_hvd.core.transport import ringloop, tcp
from spark_hvd.core.transport.rendezvous import KVClient
from spark_hvd.core.transport.tcp import (
    SEND_BUFFER_BYTES,
    SPIN_S,
    PeerAbort,
    PeerSocket,
    PeerWatcher,
    ProtocolError,
    RingExchange,
    _send_buffer_bytes,
    _tune,
    connect_mesh,
    open_listener,
    send_buffer_bytes,
)
from spark_hvd.core.transport.wire import HEADER_SIZE, make_secret

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16"]
# element counts: empty, tiny, odd, and (with the small blocks and frames below) many shared-memory blocks,
# more blocks than slots, and several TCP frames per ring chunk; two ranks exchange arrays up to 16 KiB whole
# (1001 elements) and run the ring above (200_003)
SIZES = [0, 1, 7, 1001, 200_003]
SMALL = {"shm_block_bytes": 128 * 1024, "frame_bytes": 64 * 1024, "pair_exchange_bytes": 16 * 1024}


def _data(seed: int, rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n, DTYPES.index(dtype)])
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(1, 4, n).astype(dtype)  # products over 4 ranks stay within uint8
    values = (rng.random(n) * 2 + 0.5).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16(values, np.empty(n, np.uint16))
    return values.astype(dtype)


def _expected(arrays: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    wide = [bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float64) for a in arrays]
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        out = np.sum(wide, axis=0)
        if op is ReduceOp.AVERAGE:
            out = np.trunc(out / len(arrays)) if dtype in ("int32", "int64", "uint8") else out / len(arrays)
    elif op is ReduceOp.PRODUCT:
        out = np.prod(wide, axis=0)
    elif op is ReduceOp.MIN:
        out = np.min(wide, axis=0)
    else:
        out = np.max(wide, axis=0)
    return out


def _close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    got = bf16_to_f32(got) if dtype == "bfloat16" else got.astype(np.float64)
    rtol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-5}.get(dtype, 1e-12)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=what)


def _all_collectives(seed: int, backend_kwargs: dict | None = None) -> dict:
    """Run on every rank: each collective on fresh random data, checked against numpy."""
    be = backend_from_env({**SMALL, **(backend_kwargs or {})})
    r, n = be.rank, be.size
    digest = hashlib.sha256()
    try:
        for dtype in DTYPES:
            for op in ELEMENTWISE_OPS:
                # every size for SUM; the other ops (same code path, another ufunc) at odd sizes
                sizes = SIZES if op is ReduceOp.SUM else ([1001, 200_003] if dtype == "float32" else [1001])
                for count in sizes:
                    mine = _data(seed, r, count, dtype)
                    buf = mine.copy()
                    be.allreduce(buf, op, bfloat16=dtype == "bfloat16")
                    want = _expected([_data(seed, k, count, dtype) for k in range(n)], op, dtype)
                    _close(buf, want, dtype, f"allreduce {dtype} {op} n={count}")
                    digest.update(buf.tobytes())
        # fused: several arrays of one dtype (including an empty one) reduced as one collective
        shapes = [(3, 5), (0,), (70_001,), (1,), (300, 500)]
        for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            mine = [_data(seed + 1, r * 10 + i, int(np.prod(s)), "float32").reshape(s) for i, s in enumerate(shapes)]
            bufs = [m.copy() for m in mine]
            be.allreduce_fused(bufs, op)
            for i, s in enumerate(shapes):
                want = _expected([_data(seed + 1, k * 10 + i, int(np.prod(s)), "float32") for k in range(n)],
                                 op, "float32")
                _close(bufs[i].reshape(-1), want, "float32", f"fused {op} array {i}")
                digest.update(bufs[i].tobytes())
        # allgather: the first dimension differs by rank (rank 0 contributes nothing)
        for dtype in ("float32", "int64", "uint8"):
            def rows(k: int, dtype: str = dtype) -> np.ndarray:
                return _data(seed + 2, k, k * 3 * 2, dtype).reshape(k * 3, 2)
            got = be.allgather(rows(r))
            np.testing.assert_array_equal(got, np.concatenate([rows(k) for k in range(n)]))
        big = _data(seed + 3, r, 100_000 + r, "float32")
        np.testing.assert_array_equal(be.allgather(big), np.concatenate(
            [_data(seed + 3, k, 100_000 + k, "float32") for k in range(n)]))
        # broadcast from every root, small and large
        for root in range(n):
            for count in (5, 100_001):
                buf = _data(seed + 4, r, count, "float64")
                be.broadcast(buf, root)
                np.testing.assert_array_equal(buf, _data(seed + 4, root, count, "float64"))
        # alltoall with uneven splits (some empty) and the even default
        def splits_of(k: int) -> list[int]:
            return [int(x) for x in np.random.default_rng([seed, 5, k]).integers(0, 4, n)]
        def block(k: int) -> np.ndarray:
            return _data(seed + 5, k, sum(splits_of(k)) * 3, "int32").reshape(-1, 3)
        got, recv_splits = be.alltoall(block(r), splits_of(r))
        parts = []
        for k in range(n):
            at = int(np.sum(splits_of(k)[:r]))
            parts.append(block(k)[at:at + splits_of(k)[r]])
        np.testing.assert_array_equal(got, np.concatenate(parts))
        assert recv_splits == [splits_of(k)[r] for k in range(n)]
        even = np.arange(n * 2 * 4, dtype=np.float32).reshape(n * 2, 4) + 100 * r
        got, recv_splits = be.alltoall(even)
        np.testing.assert_array_equal(got, np.concatenate([np.arange(n * 8, dtype=np.float32).reshape(n * 2, 4)
                                                           [2 * r:2 * r + 2] + 100 * k for k in range(n)]))
        assert recv_splits == [2] * n
        # reducescatter: rows not divisible by the size (the first rows % size ranks get one more), every dtype
        # below and above one small shared-memory block; float32 also over several blocks (40_001 rows); the input
        # is left as it was
        cases = [(dtype, op, rows) for dtype in DTYPES for op in (ReduceOp.SUM, ReduceOp.AVERAGE)
                 for rows in (2 * n + 1, 0)] + [("float32", ReduceOp.SUM, n - 1)]  # n - 1: a rank gets no row
        cases += [(dtype, ReduceOp.SUM, 12_001) for dtype in DTYPES]  # from 36 KB: past one small block (32 KiB)
        cases += [("float32", op, rows) for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX)
                  for rows in (4001, 40_001)] + [("float16", ReduceOp.PRODUCT, 4001), ("int64", ReduceOp.MIN, 4001)]
        for dtype, op, total_rows in cases:
            mine = _data(seed + 6, r, total_rows * 3, dtype).reshape(total_rows, 3)
            got = be.reducescatter(mine, op, bfloat16=dtype == "bfloat16")
            np.testing.assert_array_equal(mine, _data(seed + 6, r, total_rows * 3, dtype).reshape(total_rows, 3))
            want = _expected([_data(seed + 6, k, total_rows * 3, dtype) for k in range(n)], op, dtype)
            want = want.reshape(total_rows, 3)
            base, extra = divmod(total_rows, n)
            lo = r * base + min(r, extra)
            hi = lo + base + (1 if r < extra else 0)
            assert got.shape == (hi - lo, 3) and got.dtype == mine.dtype
            _close(got.reshape(-1), want[lo:hi].reshape(-1), dtype, f"reducescatter {dtype} {op} rows={total_rows}")
        be.barrier()
        return {"transport": be.transport, "digest": digest.hexdigest(),
                "topology": (be.local_rank, be.local_size, be.cross_rank, be.cross_size)}
    finally:
        be.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_match_numpy(n, shm):
    if n == 1 and not shm:
        pytest.skip("a single rank opens no transport")
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    job_id = f"coll{n}{int(shm)}{seed}"
    results = run_ranks(_all_collectives, n, env={"SPARK_HVD_SHM": "1" if shm else "0", "SPARK_HVD_TIMEOUT": "60"},
                        timeout=240, args=(seed,), job_id=job_id)
    expected_transport = "none" if n == 1 else ("shm" if shm else "tcp")
    assert [res["transport"] for res in results] == [expected_transport] * n
    # every rank ends with bit-identical results (what keeps data-parallel replicas in step)
    assert len({res["digest"] for res in results}) == 1
    assert [res["topology"] for res in results] == [(k, n, 0, 1) for k in range(n)]
    assert shm_leftovers(job_id) == []


@pytest.mark.parametrize("hosts", ["abb", "aabb"])
def test_hierarchical_across_faked_hosts(hosts):
    # ranks grouped on "hosts" by faked host identities: shared memory within a host, a TCP ring between hosts
    n = len(hosts)
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    job_id = f"hier{hosts}{seed}"
    results = run_ranks(_all_collectives, n, env=lambda r: {"SPARK_HVD_HOST_ID": hosts[r], "SPARK_HVD_TIMEOUT": "60"},
                        timeout=240, args=(seed,), job_id=job_id)
    assert [res["transport"] for res in results] == ["hier"] * n
    assert len({res["digest"] for res in results}) == 1
    expected = []
    for r, h in enumerate(hosts):
        local = [k for k in range(n) if hosts[k] == h]
        expected.append((local.index(r), len(local), sorted(set(hosts)).index(h), len(set(hosts))))
    assert [res["topology"] for res in results] == expected
    assert shm_leftovers(job_id) == []


def _hier_allreduces(seed: int) -> str:
    """Allreduces above and below the hierarchical split size through tiny shared-memory blocks and 4 slots (every
    call reuses every slot), checked against numpy; returns a digest of the results."""
    be = backend_from_env({"shm_block_bytes": 4096, "shm_slots": 4, "frame_bytes": 64 * 1024})
    digest = hashlib.sha256()
    default_piece = hier_pipeline.PIECE_MIN_BYTES
    try:
        assert be.transport == "hier"
        for dtype, op in (("float32", ReduceOp.SUM), ("float32", ReduceOp.AVERAGE), ("int32", ReduceOp.AVERAGE),
                          ("float64", ReduceOp.MIN), ("bfloat16", ReduceOp.SUM)):
            # 70_001 float32: above HIER_SPLIT_BYTES, split over the local ranks; once in one piece, once with
            # pieces of 16 KiB (uneven, 4-8 per slice: the shared-memory legs in a helper thread, hier_pipeline)
            for count, piece in ((1001, None), (70_001, None), (70_001, 16 * 1024)):
                hier_pipeline.PIECE_MIN_BYTES = piece or default_piece
                buf = _data(seed, be.rank, count, dtype)
                be.allreduce(buf, op, bfloat16=dtype == "bfloat16")
                want = _expected([_data(seed, k, count, dtype) for k in range(be.size)], op, dtype)
                _close(buf, want, dtype, f"allreduce {dtype} {op} n={count}")
                digest.update(buf.tobytes())
        return digest.hexdigest()
    finally:
        be.close()


def test_hier_pieces_ramp_at_both_ends():
    # the pipeline's pieces cover the slice exactly; cut slices start and end small (the link's idle time before
    # the first piece and after the last is their shared-memory leg) and grow by at most RAMP per piece
    mib = 1 << 20
    assert hier_pipeline.piece_sizes(3 * mib) == [3 * mib]  # below two full pieces: one piece, no pipeline
    for slice_bytes in (4 * mib, 8 * mib + 12, 32 * mib, 64 * mib + 4, 1 << 30):
        sizes = hier_pipeline.piece_sizes(slice_bytes)
        assert sum(sizes) == slice_bytes and min(sizes) > 0
        assert sizes[0] == sizes[-1] == hier_pipeline.PIECE_MIN_BYTES // 8
        assert all(max(a, b) <= hier_pipeline.RAMP * min(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
        full = -(-slice_bytes // hier_pipeline.pieces_for(slice_bytes))
        assert max(sizes) <= full


@pytest.mark.parametrize("per_host", [2, 3])
def test_hierarchical_ranks_per_host_small_blocks(per_host):
    # 2 faked hosts of 2 or 3 ranks: every local rank carries a half or a third of the array across hosts
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    job_id = f"hier{per_host}x2{seed}"
    digests = run_ranks(_hier_allreduces, 2 * per_host, env=lambda r: {"SPARK_HVD_HOST_ID": "ab"[r // per_host],
                                                                       "SPARK_HVD_TIMEOUT": "60"},
                        timeout=180, args=(seed,), job_id=job_id)
    assert len(set(digests)) == 1  # every rank holds the same bits
    assert shm_leftovers(job_id) == []


def _pair_exchange_in_frames(seed: int) -> str:
    """Two ranks exchange 400 KB arrays whole in 32 KiB frames; checked against numpy."""
    be = backend_from_env({"frame_bytes": 32 * 1024, "pair_exchange_bytes": 1 << 20})
    digest = hashlib.sha256()
    try:
        for dtype, op in (("float32", ReduceOp.SUM), ("float64", ReduceOp.AVERAGE), ("int32", ReduceOp.MAX),
                          ("bfloat16", ReduceOp.SUM)):
            count = 100_003
            buf = _data(seed, be.rank, count, dtype)
            be.allreduce(buf, op, bfloat16=dtype == "bfloat16")
            _close(buf, _expected([_data(seed, k, count, dtype) for k in range(2)], op, dtype), dtype, f"{dtype} {op}")
            digest.update(buf.tobytes())
        return digest.hexdigest()
    finally:
        be.close()


def test_pair_exchange_in_several_frames():
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    digests = run_ranks(_pair_exchange_in_frames, 2, env={"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60"},
                        timeout=120, args=(seed,))
    assert digests[0] == digests[1]  # both ranks hold the same bits


def _agreed_allreduces(seed: int, python_ranks: tuple[int, ...]) -> str:
    """``allreduce_agreed`` (two ranks over TCP, the flag as the data's first frame) with each rank agreeing or
    not, exchanged whole (3001 elements) and on the ring (200_003, odd: unequal halves, several frames each);
    ``python_ranks``: the ranks that run the Python loop (a rank tracing frames does), where the others run the
    compiled loop if built: the same frames."""
    be = backend_from_env(SMALL)
    digest = hashlib.sha256()
    if be.rank in python_ranks:
        tcp.loop.TRACE = []
    try:
        assert be.agrees_in_band
        # early frames (sent before the other's header): on the ring (7 frames per half) all of them, one, none
        ops = (("float32", ReduceOp.SUM), ("float64", ReduceOp.AVERAGE), ("int32", ReduceOp.MAX))
        for count, eager, cases in ((3001, agreed.EAGER_BYTES, ops), (200_003, agreed.EAGER_BYTES, ops),
                                    (200_003, 64 * 1024, ops[1:2]), (200_003, 0, ops[1:2])):
            agreed.EAGER_BYTES = eager
            for dtype, op in cases:
                for agreements in ((1, 1), (1, 0), (0, 1), (0, 0), (1, 1)):
                    mine = _data(seed, be.rank, count, dtype)
                    buf = mine.copy()
                    what = f"{count} {eager} {dtype} {op} {agreements}"
                    if agreements[be.rank]:
                        hit = be.allreduce_agreed(buf, op, True)
                    else:  # a read-only stand-in: never read or written
                        hit = be.allreduce_agreed(np.broadcast_to(np.zeros(1, dtype), (count,)), op, False)
                    assert hit == all(agreements), what
                    if hit:
                        want = _expected([_data(seed, k, count, dtype) for k in range(2)], op, dtype)
                        _close(buf, want, dtype, what)
                        digest.update(buf.tobytes())
                    else:  # a miss leaves the array as it was, bit for bit
                        assert buf.tobytes() == mine.tobytes(), what
        buf = _data(seed, be.rank, 1001, "float32")  # and the backend is still in step
        be.allreduce(buf, ReduceOp.SUM)
        _close(buf, _expected([_data(seed, k, 1001, "float32") for k in range(2)], ReduceOp.SUM, "float32"), "float32",
               "after")
        return digest.hexdigest()
    finally:
        be.close()


@pytest.mark.parametrize("python_ranks", [(), (1,)], ids=["same-loop", "mixed"])
def test_agreed_allreduce_reduces_only_when_both_ranks_agree(python_ranks):
    # mixed: rank 0 runs the ring in the compiled loop (where built), rank 1 in the Python loop
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    digests = run_ranks(_agreed_allreduces, 2, env={"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60"}, timeout=120,
                        args=(seed, python_ranks))
    assert digests[0] == digests[1]  # both ranks hold the same bits


def _agreed_small_on_shm(seed: int) -> str:
    """``allreduce_agreed`` of small arrays on shared memory (any number of ranks: the flag ahead of the data in the
    slot, ``ShmGroup.small_agreed``): every agreement pattern, every dtype and op it takes, against numpy; a miss
    leaves every array as it was, bit for bit."""
    be = backend_from_env(SMALL)
    r, n = be.rank, be.size
    digest = hashlib.sha256()
    patterns = [tuple(int(k != j) for k in range(n)) for j in range(n)] + [(1,) * n, (0,) * n, (1,) * n]
    try:
        for dtype in [d for d in DTYPES if d != "bfloat16"]:
            for op in ELEMENTWISE_OPS:
                limit = be.agrees_small(np.dtype(dtype), op)
                assert limit >= 16 * 1024, (dtype, op, limit)
                for count in (1, 1001, limit // np.dtype(dtype).itemsize):
                    for agreements in patterns if count == 1001 else patterns[-1:]:
                        mine = _data(seed, r, count, dtype)
                        buf = mine.copy()
                        what = f"{count} {dtype} {op} {agreements}"
                        if agreements[r]:
                            hit = be.allreduce_agreed(buf, op, True)
                        else:  # a read-only stand-in: never read or written
                            hit = be.allreduce_agreed(np.broadcast_to(np.zeros(1, dtype), (count,)), op, False)
                        assert hit == all(agreements), what
                        if hit:
                            _close(buf, _expected([_data(seed, k, count, dtype) for k in range(n)], op, dtype),
                                   dtype, what)
                            digest.update(buf.tobytes())
                        else:
                            assert buf.tobytes() == mine.tobytes(), what
        assert be.agrees_small(np.dtype("float32"), ReduceOp.SUM) < be.shm.small_bytes  # (room for the flag)
        buf = _data(seed, r, 1001, "float32")  # and the group is still in step
        be.allreduce(buf, ReduceOp.SUM)
        _close(buf, _expected([_data(seed, k, 1001, "float32") for k in range(n)], ReduceOp.SUM, "float32"),
               "float32", "after")
        return digest.hexdigest()
    finally:
        be.close()


@pytest.mark.parametrize("n", [2, 3])
def test_agreed_small_allreduce_on_shared_memory(n):
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    digests = run_ranks(_agreed_small_on_shm, n, env={"SPARK_HVD_TIMEOUT": "60"}, timeout=120, args=(seed,))
    assert len(set(digests)) == 1  # every rank holds the same bits


def _die_mid_collective(victim: int, shm: bool, agreed: bool = False) -> dict:
    be = backend_from_env()
    if be.rank == victim:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    buf = np.ones(2_000_000 if not shm else 4_000_000, dtype=np.float32)
    start = time.monotonic()
    try:
        for _ in range(100_000):
            if agreed:  # the flag as the data's first frame (speculation between two ranks over TCP)
                be.allreduce_agreed(buf, ReduceOp.AVERAGE, True)
            else:
                be.allreduce(buf, ReduceOp.AVERAGE)
        return {"error": None}
    except PeerFailureError as exc:
        return {"error": type(exc).__name__, "rank": exc.rank, "operation": exc.operation, "message": str(exc),
                "seconds": time.monotonic() - start}
    finally:
        be.close()


@pytest.mark.parametrize("transport", ["shm", "tcp", "hier", "cma", "agreed"])
def test_sigkilled_rank_is_named_by_every_other_rank(transport):
    # hier: 2 faked hosts of 2 ranks; rank 1 dies while carrying its slice (its host peer waits in shared memory);
    # cma: two ranks, whose 16 MiB allreduces read each other's buffers (shm_cma); agreed: two ranks over TCP,
    # ``allreduce_agreed``
    job_id = f"kill{transport}{os.getpid()}"
    shm, n = transport not in ("tcp", "agreed"), {"hier": 4, "cma": 2, "agreed": 2}.get(transport, 3)

    def env(rank: int) -> dict[str, str]:
        host = {"SPARK_HVD_HOST_ID": "ab"[rank // 2]} if transport == "hier" else {}
        return {"SPARK_HVD_SHM": "1" if shm else "0", "SPARK_HVD_TIMEOUT": "20", **host}

    results = run_ranks(_die_mid_collective, n, args=(1, shm, transport == "agreed"), allow_death={1}, timeout=120,
                        job_id=job_id, env=env)
    assert isinstance(results[1], RankDied) and results[1].exitcode == -signal.SIGKILL
    for r in [k for k in range(n) if k != 1]:
        res = results[r]
        assert res["error"] is not None, f"rank {r} did not notice"
        assert res["rank"] == 1, f"rank {r}: {res['message']}"
        assert res["operation"] == "allreduce"
        assert "rank 1" in res["message"]
    assert shm_leftovers(job_id) == []


def _one_rank_absent() -> dict:
    be = backend_from_env()
    client = KVClient(os.environ["SPARK_HVD_RENDEZVOUS"], bytes.fromhex(os.environ["SPARK_HVD_SECRET"]))
    try:
        if be.rank == 1:
            client.get("rank0-done", timeout_s=120)  # alive but never joins the collective
            return {}
        try:
            be.allreduce(np.ones(10, np.float32), ReduceOp.SUM)
            return {"error": None}
        except CollectiveTimeoutError as exc:
            return {"error": type(exc).__name__, "rank": exc.rank}
        finally:
            client.set("rank0-done", b"1")
    finally:
        client.close()
        be.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_absent_rank_times_out_naming_it(shm):
    results = run_ranks(_one_rank_absent, 2, env={"SPARK_HVD_SHM": "1" if shm else "0", "SPARK_HVD_TIMEOUT": "1.5"},
                        timeout=120)
    assert results[0] == {"error": "CollectiveTimeoutError", "rank": 1}


def _peer_pair(secret_a: bytes, secret_b: bytes, tcp: bool = False) -> tuple[PeerSocket, PeerSocket]:
    if tcp:  # a loopback TCP connection (the options only TCP has: TCP_WINDOW_CLAMP...)
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname(), timeout=10)
            b = server.accept()[0]
    else:
        a, b = socket.socketpair()
    sender, receiver = PeerSocket(a, secret_a, 1, 30), PeerSocket(b, secret_b, 0, 30)
    server = threading.Thread(target=lambda: receiver.handshake("server", 10) if secret_a == secret_b else None)
    server.start()
    if secret_a == secret_b:
        sender.handshake("client", 10)
    server.join(20)
    return sender, receiver


def test_small_exchange_spins_then_backs_off_after_spins_in_vain():
    """The small-message path (``RingExchange(spin=True)``) polls without sleeping for ``SPIN_S`` per wait; each
    spin that ends without the frame makes the next 1, 3, 7, ... 255 waits sleep at once (no clock involved here:
    the budget's arithmetic, then a spinning exchange whose frame comes from a thread, checked for its data)."""
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    assert receiver.spin_deadline(10.0) == 10.0 + SPIN_S
    receiver.spin_ended(False)
    assert [receiver.spin_deadline(11.0) for _ in range(2)] == [0.0, 11.0 + SPIN_S]
    receiver.spin_ended(False)
    assert [receiver.spin_deadline(12.0) for _ in range(4)] == [0.0, 0.0, 0.0, 12.0 + SPIN_S]
    for _ in range(20):
        receiver.spin_ended(False)
    skipped = 0
    while receiver.spin_deadline(13.0) == 0.0:
        skipped += 1
    assert skipped == 255
    receiver.spin_ended(True)
    assert receiver.spin_deadline(14.0) == 14.0 + SPIN_S
    payload = np.random.default_rng(5).random(1024).astype(np.float32)
    got = np.zeros_like(payload)
    later = threading.Timer(0.05, lambda: sender.send_data([payload.view(np.uint8)], "test"))
    later.start()
    try:
        RingExchange(receiver, receiver, "test", spin=True).run([], [memoryview(got).cast("B")], lambda i: None)
    finally:
        later.join()
    np.testing.assert_array_equal(got, payload)
    for peer in (sender, receiver):
        peer.sock.close()


def _both_ways(a: PeerSocket, b: PeerSocket, send_a: list[np.ndarray], send_b: list[np.ndarray],
               answer_b: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``a`` and ``b`` exchange frames on one connection, each in a thread; with ``answer_b``, ``b`` sends its
    frames only once the last of ``a``'s has arrived (each frame: ``a``'s same frame plus one)."""
    got_a, got_b = [np.zeros_like(x) for x in send_b], [np.zeros_like(x) for x in send_a]
    errors: list[BaseException] = []

    def answer(i: int) -> list[memoryview] | None:
        if i + 1 < len(got_b):
            return None
        for x, y in zip(send_b, got_b, strict=True):
            np.add(y, 1, out=x)
        return [memoryview(x) for x in send_b]

    def side(peer: PeerSocket, sends: list[np.ndarray], got: list[np.ndarray], on: Any) -> None:
        try:
            RingExchange(peer, peer, "test").run([memoryview(x) for x in sends], [memoryview(g) for g in got], on)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test)
            errors.append(exc)

    threads = [threading.Thread(target=side, args=(a, send_a, got_a, lambda i: None)),
               threading.Thread(target=side, args=(b, [] if answer_b else send_b, got_b,
                                                   answer if answer_b else (lambda i: None)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return got_a, got_b


@pytest.mark.parametrize("over_tcp", [False, True], ids=["socketpair", "tcp"])
def test_two_ranks_hold_back_to_their_peer_and_never_stall_on_it(monkeypatch, over_tcp):
    # ``RUN_AHEAD_BYTES``: a rank hands the kernel at most that many bytes beyond what came from its peer (here
    # 64 KiB, so frames go in pieces and both sides wait on each other); an exchange whose peer answers only after
    # all of it (far more than that) still completes, since a hold runs out after ``RUN_AHEAD_WAIT_MS``; over TCP
    # with the receive window clamped too (``RUN_AHEAD_WINDOW``: here 128 KiB)
    monkeypatch.setattr(tcp.loop, "RUN_AHEAD_BYTES", 64 * 1024)
    monkeypatch.setattr(tcp.peer, "LOSS_BASED_CONGESTION", frozenset())  # hold over TCP whatever the host's default
    secret = make_secret()
    a, b = _peer_pair(secret, secret, tcp=over_tcp)
    rng = np.random.default_rng(11)
    send_a = [rng.integers(0, 250, n, dtype=np.uint8) for n in (300_000, 256 * 1024, 5, 200_000)]
    send_b = [rng.integers(0, 250, n, dtype=np.uint8) for n in (300_000, 256 * 1024, 5, 200_000)]
    try:
        got_a, got_b = _both_ways(a, b, send_a, send_b, answer_b=False)
        for x, y in zip(send_a + send_b, got_b + got_a, strict=True):
            np.testing.assert_array_equal(x, y)
        got_a, got_b = _both_ways(a, b, send_a, [np.zeros_like(x) for x in send_a], answer_b=True)
        for x, y, z in zip(send_a, got_b, got_a, strict=True):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x + 1, z)
    finally:
        for peer in (a, b):
            peer.sock.close()


def test_two_ranks_couple_unless_the_congestion_control_is_loss_based():
    # ``LOSS_BASED_CONGESTION``: a connection under reno (or cubic) does not hold its directions to each other; one
    # under any other congestion control, or a socket pair (none), does
    secret = make_secret()
    pairs = [_peer_pair(secret, secret, tcp=True), _peer_pair(secret, secret, tcp=True), _peer_pair(secret, secret)]
    try:
        (reno, _), (other, _), (unix, _) = pairs
        reno.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
        assert not reno.couples_directions()
        assert unix.couples_directions()
        name = other.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
        assert other.couples_directions() == (name not in tcp.LOSS_BASED_CONGESTION)
    finally:
        for pair in pairs:
            for peer in pair:
                peer.sock.close()


def test_send_buffer_is_set_only_where_it_beats_autotuning():
    """Mesh sockets ask for ``SEND_BUFFER_BYTES`` only where net.core.wmem_max lets the kernel grant more than the
    send buffer's autotuning reaches (setting SO_SNDBUF turns autotuning off); a tuned socket has that buffer."""
    mib = 1 << 20
    assert send_buffer_bytes(4 * mib, 4 * mib) == 4 * mib  # granted 8 MiB against autotuning's 4 MiB
    assert send_buffer_bytes(212992, 4 * mib) == 0  # Linux's default wmem_max would cap it at 416 KiB
    assert send_buffer_bytes(4 * mib, 16 * mib) == 0
    assert send_buffer_bytes(1 << 30, 4 * mib) == SEND_BUFFER_BYTES
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as sock:
        _tune(sock)
        asked = _send_buffer_bytes()
        if asked:  # the kernel doubles what it is asked for (its bookkeeping overhead)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * asked


def test_ring_socket_rejects_a_tampered_data_frame():
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sender.send_data([np.arange(16, dtype=np.float32).view(np.uint8)], "test")
    raw = bytearray(receiver.sock.recv(1 << 16))
    raw[-5] ^= 0x80
    writer, reader = socket.socketpair()
    receiver.sock = reader
    writer.sendall(bytes(raw))
    with pytest.raises(AuthenticationError):
        receiver.recv_data_into(memoryview(bytearray(64)), "test")
    assert receiver.recv_broken
    for sock in (sender.sock, writer, reader):
        sock.close()


def test_ring_exchange_rejects_a_tampered_data_frame():
    # the ring's own receive loop (non-blocking, straight into the destination) checks every tag before the
    # frame is used: the frames before the tampered one are handed over, the tampered one never is
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    payloads = [np.random.default_rng(k).random(2048).astype(np.float32) for k in range(3)]
    for payload in payloads:
        sender.send_data([payload.view(np.uint8)], "test")
    frame = HEADER_SIZE + 1 + payloads[0].nbytes
    raw, need = bytearray(), frame * len(payloads)
    while len(raw) < need:
        raw += receiver.sock.recv(need - len(raw))
    raw[frame + HEADER_SIZE + 1 + 1000] ^= 0x01  # one bit of the second frame's payload
    writer, reader = socket.socketpair()
    receiver.sock = reader
    writer.sendall(bytes(raw))
    got = [np.zeros_like(p) for p in payloads]
    used: list[int] = []
    with pytest.raises(AuthenticationError, match="rank 0"):
        RingExchange(receiver, receiver, "test").run([], [memoryview(g).cast("B") for g in got],
                                                     lambda i: used.append(i))
    assert used == [0]
    np.testing.assert_array_equal(got[0], payloads[0])
    assert receiver.recv_broken
    for sock in (sender.sock, writer, reader):
        sock.close()


def _stream(sender: PeerSocket, receiver: PeerSocket, frames: list[np.ndarray], abort: bool = False) -> bytes:
    """The bytes ``sender`` puts on the wire for ``frames`` (DATA), then an ABORT naming rank 3 if ``abort``."""
    def send() -> None:
        for frame in frames:
            sender.send_data([frame.view(np.uint8)], "test")
        if abort:
            sender.send_abort(3, "rank 3 ran out of memory")
        sender.sock.shutdown(socket.SHUT_WR)

    sending = threading.Thread(target=send, daemon=True)
    sending.start()
    raw = bytearray()
    while chunk := receiver.sock.recv(1 << 20):
        raw += chunk
    sending.join(30)
    return bytes(raw)


def _trickle(raw: bytes, cuts: list[int]) -> tuple[socket.socket, threading.Thread, socket.socket]:
    """A socket that receives ``raw`` in pieces cut at ``cuts``, each sent once the one before was read (or
    after 2 s: only how the bytes arrive is at stake, never what the test checks)."""
    writer, reader = socket.socketpair()

    def feed() -> None:
        for lo, hi in zip([0, *cuts], [*cuts, len(raw)], strict=True):
            writer.sendall(raw[lo:hi])
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and _unread(writer):
                time.sleep(0.0005)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    return reader, feeder, writer


def _unread(sock: socket.socket) -> int:
    """Bytes ``sock`` sent that its peer has not read yet."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _cuts(sizes: list[int], extra: int = 0) -> list[int]:
    """Cut points around every frame's header (a byte before, at, a byte after, mid-header, at its payload) and
    in the middle of each payload."""
    cuts, at = set(), 0
    head = HEADER_SIZE + 1
    for size in sizes:
        cuts.update({at - 1, at, at + 1, at + 13, at + head, at + head + size // 2})
        at += head + size
    return sorted(c for c in cuts if 0 < c < at + extra)


@pytest.mark.parametrize("abort", [False, True], ids=["data", "abort"])
def test_ring_exchange_reads_frames_split_anywhere(abort):
    # the receive loop reads a frame's tail and the next frame's header in one call and waits for whole large
    # frames (low-water mark): whatever the pieces the bytes arrive in, every frame lands whole and in order, a
    # header is never read past the last frame expected (the next collective's first frame stays in the socket)
    # nor past frame 0 (whose answer may change what follows), and an ABORT whose header came with the frame
    # before it still names the rank it blames
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sizes = [4096, 65536, 20480, 65536, 4096]
    frames = [np.random.default_rng(k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate(sizes)]
    expected = 3 if abort else 4  # the exchange's frames; the rest is an ABORT or the next collective's frame
    raw = _stream(sender, receiver, frames[:expected], abort) if abort else _stream(sender, receiver, frames)
    reader, feeder, writer = _trickle(raw, _cuts(sizes[:expected], 64))
    receiver.sock = reader
    got = [np.zeros(n, np.uint8) for n in sizes]
    used: list[int] = []
    exchange = RingExchange(receiver, receiver, "test")
    try:
        if abort:
            with pytest.raises(PeerFailureError, match="rank 3 failed") as failure:
                exchange.run([], [memoryview(g) for g in got[:4]], used.append)
            assert failure.value.rank == 3
        else:
            exchange.run([], [memoryview(g) for g in got[:4]], used.append)
            receiver.recv_data_into(memoryview(got[4]), "test")  # the next collective's frame, intact
        assert used == list(range(expected))
        for k in range(expected if abort else 5):
            np.testing.assert_array_equal(got[k], frames[k])
    finally:
        feeder.join(30)
        for sock in (sender.sock, writer, reader):
            sock.close()


def test_ring_exchange_reads_nothing_past_frame_0_when_its_answer_ends_the_exchange():
    # ``spark_hvd.core.algorithms.agreed``: on a miss, frame 0's answer shortens the exchange; the frame after it
    # belongs to whoever reads next and must still be in the socket, header included
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    frames = [np.random.default_rng(k).integers(0, 255, n, dtype=np.uint8) for k, n in enumerate([64, 65536])]
    raw = _stream(sender, receiver, frames)
    reader, feeder, writer = _trickle(raw, [])  # both frames at once
    receiver.sock = reader
    got = [np.zeros(64, np.uint8), np.zeros(65536, np.uint8)]
    receives = [memoryview(g) for g in got]
    try:
        RingExchange(receiver, receiver, "test").run([], receives, lambda i: receives.__delitem__(slice(1, None)))
        np.testing.assert_array_equal(got[0], frames[0])
        assert not got[1].any()
        receiver.recv_data_into(memoryview(got[1]), "test")
        np.testing.assert_array_equal(got[1], frames[1])
    finally:
        feeder.join(30)
        for sock in (sender.sock, writer, reader):
            sock.close()


# -- the compiled ring loop (``ringloop``, ``_ringloop.c``) on its own terms: the Python loop's frames, errors, results

needs_compiled_loop = pytest.mark.skipif(
    ringloop._ringloop is None, reason="the compiled ring loop spark_hvd.core.transport._ringloop is not built here "
    "(`make setup` builds it where gcc and Python.h are): every ring runs the Python loop, tested above")


def test_the_compiled_ring_loop_is_built_wherever_it_can_be():
    # CI builds the extension (``make setup``): where a compiler and Python's headers are, a build that is missing or
    # does not import fails here, so a checkout never runs only the fallback unnoticed
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if shutil.which("gcc") is None or not os.path.isfile(header):
        pytest.skip("no gcc or no Python.h here: the compiled ring loop cannot be built, the Python loop runs")
    try:
        importlib.import_module("spark_hvd.core.transport._ringloop")
    except ImportError as exc:
        pytest.fail(f"spark_hvd.core.transport._ringloop does not import although gcc and {header} are here ({exc}): "
                    "`make setup` builds it")
    assert ringloop._ringloop is not None


def _frames_of(sizes: list[int], dtype: str, seed: int) -> list[np.ndarray]:
    """Random frames of ``sizes`` bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 40, n // 8).astype(dtype) if dtype == "int64" else
            rng.random(n // np.dtype(dtype).itemsize).astype(dtype) for n in sizes]


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    at = np.cumsum([0, *sizes]).tolist()
    return list(zip(at, at[1:], strict=False))


@needs_compiled_loop
@pytest.mark.parametrize("mac_mode", [1, 2], ids=["libcrypto", "cryptography"])
def test_compiled_ring_loop_rejects_a_tampered_data_frame(monkeypatch, mac_mode):
    # ``ringloop.run`` checks each frame's tag before it reduces it: the frames before the tampered one are reduced
    # into place, the tampered one and those after it never are (tags checked by either way, ``ringloop.MAC_MODE``)
    monkeypatch.setattr(ringloop, "MAC_MODE", mac_mode)
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sizes = [8192] * 3
    payloads = _frames_of(sizes, "float32", 1)
    raw = bytearray(_stream(sender, receiver, payloads))
    raw[HEADER_SIZE + 1 + sizes[0] + HEADER_SIZE + 1 + 1000] ^= 0x01  # one bit of the second frame's payload
    writer, reader = socket.socketpair()
    reader.settimeout(30)
    receiver.sock = reader
    writer.sendall(bytes(raw))
    flat = np.concatenate(_frames_of(sizes, "float32", 2))
    before = flat.copy()
    plan = [(0, lo, hi) for lo, hi in _spans(sizes)]
    try:
        with pytest.raises(AuthenticationError, match="rank 0"):
            ringloop.run(receiver, receiver, "test", flat, np.empty(8192, np.uint8), [], plan, 1, 1, ReduceOp.SUM, 2)
        np.testing.assert_array_equal(flat[:2048], before[:2048] + payloads[0])
        np.testing.assert_array_equal(flat[2048:], before[2048:])
        assert receiver.recv_broken
    finally:
        for sock in (sender.sock, writer, reader):
            sock.close()


@needs_compiled_loop
@pytest.mark.parametrize("abort", [False, True], ids=["data", "abort"])
def test_compiled_ring_loop_reads_frames_split_anywhere(abort):
    # as ``test_ring_exchange_reads_frames_split_anywhere``, through ``ringloop.run``: frames 0-1 are reduced from the
    # scratch frame and forwarded (step 0 of 2), frames 2-3 received in place (step 1); whatever the pieces the bytes
    # arrive in, every frame lands whole and in order, no header is read past the last frame planned (the next
    # collective's frame stays in the socket), an ABORT whose header came with the frame before still names the rank
    # it blames, and the forwarded frames carry the reduced bytes under the direction's next counters
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sizes = [4096, 65536, 20480, 65536, 4096]
    frames = _frames_of(sizes, "int64", 3)
    expected = 3 if abort else 4  # the ring's frames; the rest is an ABORT or the next collective's frame
    raw = _stream(sender, receiver, frames[:expected], abort) if abort else _stream(sender, receiver, frames)
    reader, feeder, writer = _trickle(raw, _cuts(sizes[:expected], 64))
    reader.settimeout(30)
    receiver.sock = reader
    spans = _spans(sizes)
    flat = np.concatenate(_frames_of(sizes[:4], "int64", 4))
    want = flat.copy()
    for k, (lo, hi) in enumerate(spans[:expected]):
        part = want[lo // 8:hi // 8]
        part[...] = part + frames[k] if k < 2 else frames[k]
    plan = [(0 if k < 2 else 1, lo, hi) for k, (lo, hi) in enumerate(spans[:4])]
    original = sender.sock
    try:
        if abort:
            with pytest.raises(PeerAbort, match="rank 3 failed") as failure:
                ringloop.run(receiver, receiver, "test", flat, np.empty(65536, np.uint8), [], plan, 1, 2,
                             ReduceOp.SUM, 2)
            assert failure.value.rank == 3
        else:
            ringloop.run(receiver, receiver, "test", flat, np.empty(65536, np.uint8), [], plan, 1, 2, ReduceOp.SUM, 2)
            following = np.zeros_like(frames[4])
            receiver.recv_data_into(memoryview(following).cast("B"), "test")  # the next collective's frame, intact
            np.testing.assert_array_equal(following, frames[4])
            feeder.join(30)
            writer.settimeout(30)
            sender.sock = writer  # what the loop forwarded, read and checked as the next rank would
            for lo, hi in spans[:2]:
                forwarded = np.zeros((hi - lo) // 8, np.int64)
                sender.recv_data_into(memoryview(forwarded).cast("B"), "test")
                np.testing.assert_array_equal(forwarded, want[lo // 8:hi // 8])
        np.testing.assert_array_equal(flat, want)
    finally:
        feeder.join(30)
        for sock in (original, writer, reader):
            sock.close()


@needs_compiled_loop
@pytest.mark.parametrize("fault", ["size", "closed"])
def test_compiled_ring_loop_names_the_peer_of_a_broken_stream(fault):
    # a frame of another size than planned (the ranks disagree on the collective): ProtocolError naming the rank,
    # before a byte of its payload is used; a peer that closes mid-frame: PeerFailureError naming it
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sizes = [8192, 16384 if fault == "size" else 8192]
    payloads = _frames_of(sizes, "float64", 5)
    raw = _stream(sender, receiver, payloads)
    writer, reader = socket.socketpair()
    reader.settimeout(30)
    receiver.sock = reader
    if fault == "closed":
        writer.sendall(raw[:len(raw) - 3000])  # frame 1's header and part of its payload, then the end
        writer.shutdown(socket.SHUT_WR)
    else:
        writer.sendall(raw)
    flat = np.concatenate(_frames_of([8192, 8192], "float64", 6))
    before = flat.copy()
    plan = [(0, lo, hi) for lo, hi in _spans([8192, 8192])]
    error, match = (ProtocolError, "rank 0 sent 16384 bytes where 8192 were expected") if fault == "size" else \
        (PeerFailureError, "connection to rank 0 failed")
    try:
        with pytest.raises(error, match=match) as failure:
            ringloop.run(receiver, receiver, "test", flat, np.empty(8192, np.uint8), [], plan, 1, 1, ReduceOp.SUM, 2)
        if fault == "closed":
            assert failure.value.rank == 0
        np.testing.assert_array_equal(flat[:1024], before[:1024] + payloads[0])
        np.testing.assert_array_equal(flat[1024:], before[1024:])
        assert receiver.recv_broken
    finally:
        for sock in (sender.sock, writer, reader):
            sock.close()


@pytest.mark.parametrize("loop", ["python", "compiled"])
def test_a_frame_left_half_sent_marks_the_send_side_broken(loop):
    # the receive side fails while a frame is half-sent: anything sent after it (an ABORT naming the culprit) would
    # land inside that frame and fail the peer's check, so either loop marks the send side broken (send_abort
    # then skips it)
    if loop == "compiled" and ringloop._ringloop is None:
        pytest.skip("the compiled ring loop is not built here")
    secret = make_secret()
    out, stalled = _peer_pair(secret, secret)  # nobody reads ``stalled``: a large frame stays half-sent
    left, inbound = _peer_pair(secret, secret)
    left.sock.shutdown(socket.SHUT_WR)  # the left neighbour goes away
    flat = np.zeros(4 << 20, np.float32)
    try:
        with pytest.raises(PeerFailureError, match="rank 0"):
            if loop == "compiled":
                ringloop.run(out, inbound, "test", flat, np.empty(0, np.uint8), [(0, flat.nbytes)], [(0, 0, 64)], 0,
                             1, ReduceOp.SUM, 2)
            else:
                RingExchange(out, inbound, "test").run([memoryview(flat).cast("B")], [memoryview(bytearray(64))],
                                                       lambda i: None)
        assert out.send_broken and inbound.recv_broken
    finally:
        for peer in (out, stalled, left, inbound):
            peer.sock.close()


def _ring_plan(p: int, n: int, bounds: list[int], sub: int, reduce_steps: int,
               total: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Ring position ``p``'s first frames and receive plan (``RingBackend._ring``) for chunks at byte ``bounds``."""
    shift = 1 if reduce_steps else 0

    def pieces(chunk: int) -> list[tuple[int, int]]:
        lo, hi = bounds[chunk], bounds[chunk + 1]
        return [(at, min(hi, at + sub)) for at in range(lo, hi, sub)]

    return pieces((p - shift) % n), [(t, lo, hi) for t in range(total) for lo, hi in pieces((p - t - shift - 1) % n)]


def _python_ring(peer: PeerSocket, flat: np.ndarray, first: list[tuple[int, int]], plan: list[tuple[int, int, int]],
                 reduce_steps: int, total: int, op: ReduceOp, n: int) -> None:
    """What ``ringloop.run`` does, with the Python loop (``RingBackend._ring`` without the compiled loop)."""
    item, raw = flat.itemsize, flat.view(np.uint8)
    scratch = memoryview(np.empty(max(hi - lo for _, lo, hi in plan), np.uint8))
    receives = [scratch[:hi - lo] if t < reduce_steps else memoryview(raw[lo:hi]) for t, lo, hi in plan]

    def received(i: int) -> memoryview | None:
        t, lo, hi = plan[i]
        if t < reduce_steps:
            part = flat[lo // item:hi // item]
            reduce_into(part, np.frombuffer(receives[i], dtype=flat.dtype), ReduceOp.SUM)
            if op is ReduceOp.AVERAGE and t == reduce_steps - 1:
                divide_average(part, n)
        return memoryview(raw[lo:hi]) if t + 1 < total else None

    RingExchange(peer, peer, "test").run([memoryview(raw[lo:hi]) for lo, hi in first], receives, received)


@needs_compiled_loop
@pytest.mark.parametrize("compiled_rank, mac_mode", [(0, 2), (1, 1)], ids=["rank0-cryptography", "rank1-libcrypto"])
def test_compiled_and_python_ring_loops_interoperate(monkeypatch, compiled_rank, mac_mode):
    # one rank of a two-rank ring runs ``ringloop.run``, the other the Python loop, on one TCP connection, both
    # holding to ``RUN_AHEAD_BYTES`` (here 64 KiB) ahead of each other: an allreduce SUM of float32 and AVERAGE of
    # float64 (odd sizes, several 16 KiB frames per chunk) and an allgather in a row (the frame counters carry over),
    # bit for bit numpy's (two ranks: one addition per element, the same in either loop); the compiled loop tags
    # with ``cryptography`` under the GIL or with the system's libcrypto without it (``ringloop.MAC_MODE``): the
    # same tags
    monkeypatch.setattr(ringloop, "MAC_MODE", mac_mode)
    monkeypatch.setattr(tcp.loop, "RUN_AHEAD_BYTES", 64 * 1024)  # both loops' (``tcp.loop.run_ahead_bytes``)
    monkeypatch.setattr(tcp.peer, "LOSS_BASED_CONGESTION", frozenset())
    secret = make_secret()
    to_rank_1, to_rank_0 = _peer_pair(secret, secret, tcp=True)  # rank 0's socket to rank 1, rank 1's to rank 0
    peers = [to_rank_1, to_rank_0]
    rng = np.random.default_rng(compiled_rank)
    try:
        for dtype, op, count, reduce_steps, gather_steps in (("float32", ReduceOp.SUM, 30_001, 1, 1),
                                                             ("float64", ReduceOp.AVERAGE, 20_003, 1, 1),
                                                             ("uint8", ReduceOp.SUM, 50_001, 0, 1)):
            data = [rng.random(count).astype(dtype) if dtype != "uint8" else
                    rng.integers(0, 256, count, dtype=np.uint8) for _ in range(2)]
            bounds = [b * data[0].itemsize for b in even_bounds(count, 2)]
            flats = [d.copy() for d in data]
            if not reduce_steps:  # an allgather: each rank holds its own chunk
                flats[0][bounds[1]:] = 0
                flats[1][:bounds[1]] = 0
            total = reduce_steps + gather_steps
            plans = [_ring_plan(r, 2, bounds, 16 * 1024, reduce_steps, total) for r in range(2)]
            scratch = np.empty(16 * 1024 if reduce_steps else 0, np.uint8)
            calls = [functools.partial(ringloop.run, peers[r], peers[r], "test", flats[r], scratch, *plans[r],
                                       reduce_steps, total, op, 2) if r == compiled_rank else
                     functools.partial(_python_ring, peers[r], flats[r], *plans[r], reduce_steps, total, op, 2)
                     for r in range(2)]
            on_threads(2, lambda k, calls=calls: calls[k]())
            if dtype == "uint8":
                want = np.concatenate([data[0][:bounds[1]], data[1][bounds[1]:]])
            else:
                want = data[0] + data[1]
                if op is ReduceOp.AVERAGE:
                    want /= 2
            for r in range(2):
                np.testing.assert_array_equal(flats[r], want, err_msg=f"{dtype} {op} rank {r}")
    finally:
        for peer in peers:
            peer.sock.close()


def _mixed_loop_collectives(seed: int, python_ranks: tuple[int, ...] = ()) -> dict:
    """Allreduces above the recursive-doubling size (so on the ring), an allgather and a reducescatter, checked
    against numpy; compiled rings use 16 KiB frames here, the Python loop's 64 KiB (``SMALL``): ranks that
    disagreed on the frame layout would fail with ``ProtocolError``. ``python_ranks`` run the Python loop on the
    compiled loop's frames (a rank tracing frames does)."""
    ringloop.FRAME_BYTES = 16 * 1024
    be = backend_from_env(SMALL)
    digest = hashlib.sha256()
    if be.rank in python_ranks:
        tcp.loop.TRACE = []
    try:
        for dtype, op, count in (("float32", ReduceOp.SUM, 60_001), ("float32", ReduceOp.AVERAGE, 60_001),
                                 ("float64", ReduceOp.SUM, 30_001), ("float64", ReduceOp.AVERAGE, 30_001),
                                 ("int64", ReduceOp.SUM, 30_001)):
            buf = _data(seed, be.rank, count, dtype)
            be.allreduce(buf, op)
            _close(buf, _expected([_data(seed, k, count, dtype) for k in range(be.size)], op, dtype), dtype,
                   f"allreduce {dtype} {op} n={count}")
            digest.update(buf.tobytes())

        # fused: one ring over the arrays where they lie (compiled), or packed in the same frames (Python)
        sizes = [5, 20_000, 3, 1, 17_000, 700]  # two of 64 KiB and more: the frames are cut at their ends
        mine = [_data(seed + 2, be.rank * 10 + i, n, "float32") for i, n in enumerate(sizes)]
        be.allreduce_fused(mine, ReduceOp.AVERAGE)
        for i, n in enumerate(sizes):
            _close(mine[i], _expected([_data(seed + 2, k * 10 + i, n, "float32") for k in range(be.size)],
                                      ReduceOp.AVERAGE, "float32"), "float32", f"fused array {i}")
            digest.update(mine[i].tobytes())

        def rows(k: int) -> np.ndarray:
            return _data(seed + 1, k, (k + 1) * 20_001, "float32").reshape(-1, 3)

        got = be.allgather(rows(be.rank))
        np.testing.assert_array_equal(got, np.concatenate([rows(k) for k in range(be.size)]))
        # reducescatter: the compiled loop over the chunks it reduces into (copies) and the one it only sends (the
        # input), the Python loop on a copy of the input, in the same frames
        whole = [_data(seed + 3, k, 60_001, "float32") for k in range(be.size)]
        mine = whole[be.rank].copy()
        got = be.reducescatter(mine, ReduceOp.SUM)
        np.testing.assert_array_equal(mine, whole[be.rank])
        lo = be.rank * 20_000 + min(be.rank, 1)
        _close(got, _expected(whole, ReduceOp.SUM, "float32")[lo:lo + got.size], "float32", "reducescatter")
        return {"transport": be.transport, "compiled": be._compiled, "python": tcp.loop.TRACE is not None,
                "digest": digest.hexdigest()}
    finally:
        be.close()


@needs_compiled_loop
def test_ranks_with_and_without_the_compiled_loop_share_a_ring():
    # np=3 over TCP: rank 1 runs the Python loop (on the compiled loop's frame layout since every rank has the
    # compiled loop), ranks 0 and 2 the compiled loop; then a job where rank 2 turns the compiled loop
    # off (SPARK_HVD_COMPILED_RING=false: no rank uses its layout). Same data: the same bits in both jobs (the same
    # additions in the same order, whichever loop made them)
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    base = {"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60"}
    mixed = run_ranks(_mixed_loop_collectives, 3, env=base, timeout=120, args=(seed, (1,)))
    assert [(res["transport"], res["compiled"], res["python"]) for res in mixed] == [("tcp", True, r == 1)
                                                                                     for r in range(3)]
    off = run_ranks(_mixed_loop_collectives, 3, timeout=120, args=(seed,),
                    env=lambda r: {**base, "SPARK_HVD_COMPILED_RING": "false" if r == 2 else "true"})
    assert [(res["transport"], res["compiled"]) for res in off] == [("tcp", False)] * 3
    assert len({res["digest"] for res in mixed + off}) == 1


def _close_after(sender: PeerSocket, bye: bool) -> None:
    if bye:
        sender.send_bye()
    sender.sock.shutdown(socket.SHUT_RDWR)
    sender.sock.close()


@pytest.mark.parametrize("pending", [0, 2])
def test_a_peer_that_said_bye_is_not_taken_for_dead(pending):
    # a rank that finished the last collective closes while its peers still wait (on shared memory): their
    # liveness checks must not blame it, whether or not its last frames are still unread; what it sent stays
    # readable, and a receive it never sends names it
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    sent = [np.random.default_rng(k).random(1000) for k in range(pending)]
    for array in sent:
        sender.send_data([array.view(np.uint8)], "test")
    _close_after(sender, bye=True)
    watcher = PeerWatcher([receiver])
    for _ in range(3):
        watcher.check("test")  # no PeerFailureError
    for array in sent:
        got = np.zeros_like(array)
        receiver.recv_data_into(memoryview(got).cast("B"), "test")
        np.testing.assert_array_equal(got, array)
    watcher.check("test")
    with pytest.raises(PeerFailureError, match="rank 0 closed its connection"):
        receiver.recv_data_into(memoryview(bytearray(64)), "test")
    receiver.sock.close()


@pytest.mark.parametrize("pending", [0, 2])
def test_a_peer_that_closed_without_bye_is_named_dead(pending):
    secret = make_secret()
    sender, receiver = _peer_pair(secret, secret)
    for k in range(pending):
        sender.send_data([np.random.default_rng(k).random(1000).view(np.uint8)], "test")
    _close_after(sender, bye=False)
    watcher = PeerWatcher([receiver])
    deadline = time.monotonic() + 10
    with pytest.raises(PeerFailureError, match="connection to rank 0 failed"):
        while time.monotonic() < deadline:  # the EOF is seen by the first poll that reports it
            watcher.check("test")
            time.sleep(0.01)
    receiver.sock.close()


def test_mesh_setup_drops_intruders_and_survives_a_silent_client():
    secret = make_secret()
    listeners = [open_listener("127.0.0.1") for _ in range(2)]
    addresses = [ls.getsockname() for ls in listeners]
    # before the ranks start: a silent client (sends half a hello, then nothing), an intruder without the
    # secret, and raw garbage all connect to rank 0; rank 0 must still accept rank 1 at once
    silent = socket.create_connection(addresses[0])
    silent.sendall(b"SHVD")
    garbage = socket.create_connection(addresses[0])
    garbage.sendall(b"\xff" * 200)
    intruder = PeerSocket(socket.create_connection(addresses[0]), make_secret(), 1, 30)
    intruder_errors: list[BaseException] = []

    def intrude() -> None:
        try:
            intruder.send_data([b"job\n1"], "setup", b"\x02")
        except Exception as exc:
            intruder_errors.append(exc)

    meshes: dict[int, dict] = {}

    def join(rank: int) -> None:
        meshes[rank] = connect_mesh(rank, 2, listeners[rank], addresses, secret, "job", 60)

    threads = [threading.Thread(target=intrude)] + [threading.Thread(target=join, args=(r,)) for r in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(meshes) == {0, 1}
    assert time.monotonic() - start < 8  # not the 10 s handshake timeout of the silent client
    meshes[1][0].send_data([b"hello"], "test")
    assert meshes[0][1].recv_message("test") == b"hello"
    assert len(intruder_errors) == 1 and isinstance(intruder_errors[0], AuthenticationError | PeerFailureError)
    for mesh in meshes.values():
        for peer in mesh.values():
            peer.close()
    for sock in (silent, garbage, intruder.sock):
        sock.close()
