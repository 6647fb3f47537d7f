"""Recursive doubling (``spark_hvd.core.algorithms.recursive_doubling``) over the TCP mesh at N = 3, 4, 5, 8 and
recursive halving and doubling (``spark_hvd.core.algorithms.halving_doubling``) in threads at N = 2..11 and over the TCP
mesh at N = 3, 5, 8: every op and dtype against numpy, bit-identical on every rank, and a killed rank named by every
other one."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import threading
import time

import numpy as np
import pytest
from helpers.ranks import RankDied, backend_from_env, run_ranks

from spark_hvd.core.algorithms import halving_doubling, recursive_doubling
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import PeerFailureError
from spark_hvd.core.reduce import ELEMENTWISE_OPS, bf16_to_f32, f32_to_bf16

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16"]
COUNTS = [1, 7, 1001, 4099]  # every one under the threshold below; 4099 float64: several frames
LOG_DEPTH = {"SPARK_HVD_SHM": "0", "SPARK_HVD_LOG_DEPTH_BYTES": str(64 * 1024), "SPARK_HVD_TIMEOUT": "60"}
HALVING = {**LOG_DEPTH, "SPARK_HVD_LOG_DEPTH_BYTES": "0", "SPARK_HVD_HALVING_DOUBLING_BYTES": "1"}  # every size


@pytest.mark.parametrize("n", range(2, 17))
def test_every_member_meets_every_other_once_through_the_plan(n):
    # simulate the plan on positions: each holds a set of contributions; all end with every one exactly once
    held = [{p} for p in range(n)]
    plans = [recursive_doubling.steps(p, n) for p in range(n)]
    for p, (to, partners) in enumerate(plans):
        if to is not None:
            assert plans[to][0] is None and not partners
            held[to] |= held[p]
    rounds = max(len(partners) for _, partners in plans)
    for k in range(rounds):
        pairs = {(p, plans[p][1][k]) for p in range(n) if plans[p][0] is None}
        assert all((q, p) in pairs for p, q in pairs)  # exchanges are mutual
        snapshot = [set(h) for h in held]
        for p, q in pairs:
            assert not snapshot[p] & snapshot[q]  # nothing counted twice
            held[p] = snapshot[p] | snapshot[q]
    for p, (to, _) in enumerate(plans):
        if to is not None:
            held[p] = held[to]
    assert all(h == set(range(n)) for h in held)


def _data(seed: int, rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, count, DTYPES.index(dtype)])
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(0, 2 if dtype == "uint8" else 4, count).astype(dtype)  # products of 8 ranks fit
    values = (rng.random(count) * 2 + 0.5).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16(values, np.empty(count, np.uint16))
    return values.astype(dtype)


def _expected(arrays: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    wide = np.stack([bf16_to_f32(a) if dtype == "bfloat16" else a.astype(np.float64) for a in arrays])
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        out = wide.sum(axis=0)
        if op is ReduceOp.AVERAGE:
            out = np.trunc(out / len(arrays)) if dtype in ("int32", "int64", "uint8") else out / len(arrays)
        return out
    return {ReduceOp.PRODUCT: np.prod, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}[op](wide, axis=0)


def _every_op_and_dtype(seed: int) -> dict:
    be = backend_from_env()
    r, n = be.rank, be.size
    digest = hashlib.sha256()
    try:
        for dtype in DTYPES:
            rtol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-5}.get(dtype, 1e-12)
            for op in ELEMENTWISE_OPS:
                for count in COUNTS if op is ReduceOp.SUM else COUNTS[2:3]:
                    buf = _data(seed, r, count, dtype)
                    be.allreduce(buf, op, bfloat16=dtype == "bfloat16")
                    want = _expected([_data(seed, k, count, dtype) for k in range(n)], op, dtype)
                    got = bf16_to_f32(buf) if dtype == "bfloat16" else buf.astype(np.float64)
                    np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=f"{dtype} {op} {count}")
                    digest.update(buf.tobytes())
        fused = [_data(seed + 1, r * 3 + i, c, "float32") for i, c in enumerate((5, 0, 300))]
        be.allreduce_fused(fused, ReduceOp.AVERAGE)  # packed into one array below the threshold
        for i, c in enumerate((5, 0, 300)):
            want = _expected([_data(seed + 1, k * 3 + i, c, "float32") for k in range(n)], ReduceOp.AVERAGE,
                             "float32")
            np.testing.assert_allclose(fused[i], want, rtol=1e-5)
        return {"transport": be.transport, "digest": digest.hexdigest()}
    finally:
        be.close()


@pytest.mark.parametrize("n", [3, 4, 5, pytest.param(8, marks=pytest.mark.slow)])  # 8 ranks: slow
def test_recursive_doubling_matches_numpy_and_is_bit_identical_on_every_rank(n):
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    results = run_ranks(_every_op_and_dtype, n, env=LOG_DEPTH, timeout=300, args=(seed,))
    assert {res["transport"] for res in results} == {"tcp"}
    assert len({res["digest"] for res in results}) == 1


def _die_in_small_allreduces(victim: int) -> dict:
    be = backend_from_env()
    if be.rank == victim:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    buf = np.ones(1024, dtype=np.float32)
    start = time.monotonic()
    try:
        for _ in range(10_000_000):
            be.allreduce(buf, ReduceOp.AVERAGE)
        return {"error": None}
    except PeerFailureError as exc:
        return {"error": type(exc).__name__, "rank": exc.rank, "message": str(exc),
                "seconds": time.monotonic() - start}
    finally:
        be.close()


def test_a_rank_killed_in_recursive_doubling_is_named_by_every_other_rank():
    n, victim = 5, 1  # rank 1 is a folded odd member (it carries rank 0's array): everyone depends on it
    results = run_ranks(_die_in_small_allreduces, n, args=(victim,), allow_death={victim}, timeout=120,
                        env={**LOG_DEPTH, "SPARK_HVD_TIMEOUT": "20"})
    assert isinstance(results[victim], RankDied)
    for r in (k for k in range(n) if k != victim):
        assert results[r]["error"] is not None, f"rank {r} did not notice"
        assert results[r]["rank"] == victim, f"rank {r}: {results[r]['message']}"
        assert results[r]["seconds"] < 20, f"rank {r} took {results[r]['seconds']:.1f} s"


def test_recursive_doubling_between_the_leaders_of_three_hosts():
    # ranks 0-1 share host a, 2 and 3 are alone on b and c: the leaders' leg is recursive doubling among three
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    hosts = "aabc"
    results = run_ranks(_every_op_and_dtype, 4, args=(seed,), timeout=300,
                        env=lambda r: {**LOG_DEPTH, "SPARK_HVD_SHM": "1", "SPARK_HVD_HOST_ID": hosts[r]})
    assert {res["transport"] for res in results} == {"hier"}
    assert len({res["digest"] for res in results}) == 1


class _QueuePeers:
    """``recursive_doubling.Peers`` between threads of this process (a queue per direction)."""

    def __init__(self, me: int, queues: dict[tuple[int, int], queue.Queue]) -> None:
        self.me, self.queues = me, queues

    def send(self, dst: int, data: np.ndarray) -> None:
        self.queues[(self.me, dst)].put(data.copy())

    def recv(self, src: int, into: np.ndarray) -> None:
        data = self.queues[(src, self.me)].get(timeout=60)
        assert data.nbytes == into.nbytes, (data.nbytes, into.nbytes)
        into[...] = data

    def exchange(self, peer: int, data: np.ndarray, into: np.ndarray) -> None:
        self.send(peer, data)
        self.recv(peer, into)


def _halving_doubling_in_threads(datas: list[np.ndarray], op: ReduceOp) -> list[np.ndarray]:
    """Every member's result of ``halving_doubling.allreduce`` of ``datas``, run in one thread each."""
    n = len(datas)
    bufs = [d.copy() for d in datas]
    queues = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    errors: list[BaseException] = []

    def member(r: int) -> None:
        try:
            scratch = np.empty(halving_doubling.scratch_bytes(bufs[r].size, bufs[r].itemsize, n), np.uint8)
            halving_doubling.allreduce(bufs[r], op, False, list(range(n)), r, _QueuePeers(r, queues), scratch)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return bufs


@pytest.mark.parametrize("n", range(2, 12))
def test_halving_doubling_in_threads_matches_numpy_for_every_op(n):
    for count in (1, 5, 64, 1001):  # fewer items than members, uneven blocks (padded), even ones
        for op in ELEMENTWISE_OPS:
            datas = [_data(n, r, count, "float64") for r in range(n)]
            bufs = _halving_doubling_in_threads(datas, op)
            want = _expected(datas, op, "float64")
            for buf in bufs:
                np.testing.assert_allclose(buf, want, rtol=1e-12, err_msg=f"n={n} {op} {count}")
                assert buf.tobytes() == bufs[0].tobytes()  # bit-identical on every member


@pytest.mark.parametrize("n", [3, 5, pytest.param(8, marks=pytest.mark.slow)])  # 8 ranks: slow
def test_halving_doubling_over_tcp_matches_numpy_and_is_bit_identical_on_every_rank(n):
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    results = run_ranks(_every_op_and_dtype, n, env=HALVING, timeout=300, args=(seed,))
    assert {res["transport"] for res in results} == {"tcp"}
    assert len({res["digest"] for res in results}) == 1


def test_a_rank_killed_in_halving_doubling_is_named_by_every_other_rank():
    n, victim = 5, 1  # a folded odd member again
    results = run_ranks(_die_in_small_allreduces, n, args=(victim,), allow_death={victim}, timeout=120,
                        env={**HALVING, "SPARK_HVD_TIMEOUT": "20"})
    assert isinstance(results[victim], RankDied)
    for r in (k for k in range(n) if k != victim):
        assert results[r]["error"] is not None, f"rank {r} did not notice"
        assert results[r]["rank"] == victim, f"rank {r}: {results[r]['message']}"
