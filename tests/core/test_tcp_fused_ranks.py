"""A fused allreduce over TCP among three and four ranks (``TcpRing``, the compiled loop on every rank): a round large
enough for the ring is reduced where its arrays lie (``RingBackend._tcp_allreduce_fused``), bit for bit as the same
arrays packed into one and reduced, and as numpy (exactly for integers, to rounding for floats), over ragged arrays
that cut frames and chunk bounds, every op and dtype the compiled loop takes; a smaller round is packed. Through the
engine (``HostGroup`` and the executor: a whole round in one collective): AVERAGE with prescale and postscale, no
fusion buffer, the same bits as a packing backend, and a shape mismatch in a learned round still named. Ranks are
threads of this process (the compiled loop waits without the GIL), so a job costs milliseconds, not a spawn."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends import ring_plans
from spark_hvd.core.backends.ring import SEGMENT_CUT_BYTES, RingBackend
from spark_hvd.core.engine.engine import Engine
from spark_hvd.core.errors import TensorMismatchError
from spark_hvd.core.reduce import bf16_to_f32, f32_to_bf16
from spark_hvd.core.settings import Settings
from spark_hvd.core.transport import ringloop
from spark_hvd.core.transport.rendezvous import StaticRendezvous
from spark_hvd.core.transport.wire import make_secret
from tests.helpers.ranks import on_threads

pytestmark = pytest.mark.skipif(not ringloop.BUILT, reason="the compiled ring loop is not built here")

FRAME = 32 * 1024  # the smallest frame (``INLINE_SEND_BYTES``): many frames, some across arrays
TCP = Settings(shm=False, timeout_s=30.0, cycle_time_ms=1.0)


def _on_ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on one thread per rank (``on_threads``); the results by rank."""
    out: list[Any] = [None] * n

    def keep(r: int) -> None:
        out[r] = fn(r)

    on_threads(n, keep)
    return out


def _tcp_job(n: int, settings: Settings = TCP) -> list[RingBackend]:
    """``n`` ring backends over the TCP mesh (shared memory off), one per thread of this process."""
    values: list[bytes] = [b""] * n
    met = threading.Barrier(n)

    def exchange(rank: int, size: int, value: bytes) -> list[bytes]:
        values[rank] = value
        met.wait(30)
        return list(values)

    secret = make_secret()
    return _on_ranks(n, lambda r: RingBackend(r, n, StaticRendezvous(exchange), secret, settings,
                                              f"tcpfuse{n}", frame_bytes=FRAME))


@pytest.fixture(scope="module", params=[3, 4])
def job(request):
    backends = _tcp_job(request.param)
    yield backends
    for be in backends:
        be.close()


def _counts(itemsize: int, rng: np.random.Generator) -> list[int]:
    """Ragged sizes (elements), shuffled, ~200 KiB in all: single elements, arrays a frame crosses, arrays from
    ``SEGMENT_CUT_BYTES`` (the frames are cut at their ends); the chunk bounds fall inside arrays."""
    big, frame = SEGMENT_CUT_BYTES // itemsize, FRAME // itemsize
    counts = [1, 1, 2, 5, 333, frame - 1, frame + 3, 2 * frame + 7, big, big + 1] + rng.integers(1, 900, 8).tolist()
    return [int(c) for c in rng.permutation(counts)]


def _data(dtype: str, rng: np.random.Generator, count: int, op: ReduceOp) -> np.ndarray:
    if dtype == "bfloat16":
        return f32_to_bf16(rng.standard_normal(count).astype(np.float32) * 8, np.empty(count, np.uint16))
    if dtype.startswith("float"):
        return (rng.standard_normal(count) * 8).astype(dtype)
    info = np.iinfo(dtype)
    if op is ReduceOp.PRODUCT:  # small factors: the products wrap rarely, and exactly as numpy's
        return rng.integers(0 if info.min == 0 else -3, 4, count).astype(dtype)
    return rng.integers(info.min // 4, info.max // 4, count, dtype=dtype, endpoint=True)


def _numpy(arrays: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction over the ranks' packed arrays by numpy (floats in float64; 16-bit floats from float32)."""
    wide = [bf16_to_f32(a) if dtype == "bfloat16" else a for a in arrays]
    if dtype.startswith("float") or dtype == "bfloat16":
        wide = [a.astype(np.float64) for a in wide]
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
             ReduceOp.PRODUCT: np.multiply}[op]
    out = wide[0].copy()
    for a in wide[1:]:
        ufunc(out, a, out=out)
    if op is ReduceOp.AVERAGE:
        out = out / len(arrays) if out.dtype.kind == "f" else np.trunc(out / len(arrays)).astype(out.dtype)
    return out


_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "int32", "uint32",
           "int64", "uint64"]
# every dtype under SUM, every op on float32, the others spread over the dtypes
_CASES = [(d, ReduceOp.SUM) for d in _DTYPES] + [("float32", op) for op in ReduceOp if op not in (
    ReduceOp.SUM, ReduceOp.ADASUM)] + [("float16", ReduceOp.AVERAGE), ("bfloat16", ReduceOp.AVERAGE),
                                       ("float64", ReduceOp.MAX), ("int8", ReduceOp.MIN), ("uint8", ReduceOp.MAX),
                                       ("int32", ReduceOp.PRODUCT), ("uint64", ReduceOp.PRODUCT),
                                       ("int64", ReduceOp.AVERAGE), ("uint16", ReduceOp.MIN)]


def test_a_large_round_is_reduced_where_it_lies_as_packed_and_as_numpy(job, monkeypatch):
    n = len(job)
    assert all(be.transport == "tcp" and be.fuses_in_place for be in job)
    ran: list[bool] = []
    fused = RingBackend._tcp_allreduce_fused

    def spy(self, *args, **kwargs):
        ran.append(fused(self, *args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(RingBackend, "_tcp_allreduce_fused", spy)
    for dtype, op in _CASES:
        bfloat16 = dtype == "bfloat16"
        item = np.dtype("uint16" if bfloat16 else dtype).itemsize
        rng = np.random.default_rng([n, _DTYPES.index(dtype), list(ReduceOp).index(op)])
        counts = _counts(item, rng)
        mine = [[_data(dtype, rng, c, op) for c in counts] for _ in range(n)]
        packed = [np.concatenate(arrays) for arrays in mine]
        want = _numpy(packed, op, dtype)
        bounds = [b * item for b in ring_plans.even_bounds(sum(counts), n)[1:-1]]
        ends = (np.cumsum(counts) * item).tolist()
        assert not set(bounds) & set(ends)  # the chunk bounds cut arrays
        ran.clear()

        def both(r: int, mine=mine, packed=packed, op=op, bfloat16=bfloat16) -> None:
            with np.errstate(all="ignore"):
                job[r].allreduce_fused(mine[r], op, bfloat16=bfloat16)
                job[r].allreduce(packed[r], op, bfloat16=bfloat16)

        _on_ranks(n, both)
        assert ran == [True] * n, (dtype, op)  # every rank ran the ring over the arrays, none packed them
        for r in range(n):
            got = np.concatenate(mine[r])
            np.testing.assert_array_equal(got.view(np.uint8), packed[r].view(np.uint8), f"{dtype} {op.name} rank {r}")
            if dtype.startswith("float") or bfloat16:
                wide = bf16_to_f32(got) if bfloat16 else got.astype(np.float64)
                rtol = {"float64": 1e-12, "float32": 1e-5}.get(dtype, 2e-2)
                np.testing.assert_allclose(wide, want, rtol=rtol, atol=rtol * 8 * n, err_msg=f"{dtype} {op.name}")
            else:
                np.testing.assert_array_equal(got, want, f"{dtype} {op.name} rank {r}")


def test_a_round_below_the_ring_is_packed(job, monkeypatch):
    # at most ``log_depth_bytes``: recursive doubling over the arrays packed into one (one log-depth exchange)
    n = len(job)
    ran: list[bool] = []
    fused = RingBackend._tcp_allreduce_fused
    monkeypatch.setattr(RingBackend, "_tcp_allreduce_fused",
                        lambda self, *a, **k: ran.append(fused(self, *a, **k)) or ran[-1])
    rng = np.random.default_rng(n)
    mine = [[rng.standard_normal(c).astype(np.float32) for c in (1, 300, 4000, 7)] for _ in range(n)]
    want = [np.concatenate(arrays) for arrays in mine]
    _on_ranks(n, lambda r: (job[r].allreduce_fused(mine[r], ReduceOp.AVERAGE),
                            job[r].allreduce(want[r], ReduceOp.AVERAGE)))
    assert ran == [False] * n
    for r in range(n):
        np.testing.assert_array_equal(np.concatenate(mine[r]), want[r])


def test_halving_doubling_leaves_the_packing_to_the_engine():
    backends = _tcp_job(3, replace(TCP, halving_doubling_bytes=1 << 20))
    try:
        assert not any(be.fuses_in_place for be in backends)
    finally:
        for be in backends:
            be.close()


def _engine_rounds(n: int, rounds: int, bad_round: int = -1) -> list[dict]:
    """``rounds`` steps of 30 ragged float32 tensors (1.5 MB: above what a speculation packs among 3+ ranks over TCP,
    so every round's collective is the executor's; AVERAGE, prescale 0.5, postscale 3) through an engine per
    rank over TCP; at ``bad_round`` rank n-1 submits ``g.7`` in another shape. What each rank saw, by rank. The
    values are random integers: every grouping of the tensors into collectives (rounds differ from run to run) and
    every order of the sum gives the same bits, those of numpy in float32."""
    backends = _tcp_job(n)
    engines = [Engine(be, TCP) for be in backends]
    counts = [1, 5, 1000, 9000, 17, 300000, 3, 40000] + [200 + 37 * k for k in range(22)]  # 1.5 MB a round

    def rank(r: int) -> dict:
        eng = engines[r]
        seen: dict[str, Any] = {"results": [], "errors": []}
        for step in range(rounds):
            rng = np.random.default_rng([step, r])
            grads = [rng.integers(-1000, 1000, c + (step == bad_round and r == n - 1 and k == 7)).astype(np.float32)
                     for k, c in enumerate(counts)]
            inputs = [g.copy() for g in grads]
            handles = [eng.enqueue("allreduce", g, f"g.{k}", op=ReduceOp.AVERAGE, prescale=0.5, postscale=3.0)
                       for k, g in enumerate(grads)]
            for k, h in enumerate(handles):
                try:
                    h.wait()
                except TensorMismatchError as exc:
                    seen["errors"].append((step, k, exc.name, str(exc)))
            seen["results"].append((inputs, grads))
        seen["stats"] = dict(eng.stats)
        seen["fusion_buffers"] = len(eng._executor.host._fusion_buffers)
        return seen

    try:
        return _on_ranks(n, rank)
    finally:
        _on_ranks(n, lambda r: engines[r].shutdown())  # together: each waits for the others' goodbye
        for be in backends:
            be.close()


def _average(inputs: list[np.ndarray], n: int) -> np.ndarray:
    """numpy's float32 AVERAGE of the ranks' tensors with prescale 0.5 and postscale 3 (exact up to the division)."""
    total = sum(x * np.float32(0.5) for x in inputs)
    return (total / np.float32(n)) * np.float32(3.0)


@pytest.mark.parametrize("n", [3, 4])
def test_the_engine_fuses_where_the_tensors_lie_as_a_packing_backend_and_names_a_mismatch(monkeypatch, n):
    rounds, bad = 6, 5
    in_place = _engine_rounds(n, rounds, bad)
    monkeypatch.setattr(ring_plans.TcpRing, "fuses", lambda self, backend: False)
    packing = _engine_rounds(n, rounds - 1)
    for r in range(n):
        mine, theirs = in_place[r], packing[r]
        assert mine["fusion_buffers"] == 0 and theirs["fusion_buffers"] == 1  # no copy in and out, and one
        assert mine["stats"]["fused_collectives"] >= rounds - 1  # (a round may come in two on a loaded machine)
        for step in range(rounds):
            inputs = [[in_place[q]["results"][step][0][k] for q in range(n)] for k in range(30)]
            for k, got in enumerate(mine["results"][step][1]):
                if step == bad and k == 7:
                    continue
                want = _average(inputs[k], n)
                np.testing.assert_array_equal(got, want, f"step {step} g.{k} rank {r}")
                if step < bad:
                    np.testing.assert_array_equal(theirs["results"][step][1][k], want, f"packed: step {step} g.{k}")
        # the mismatched tensor fails on every rank naming it and rank n-1; its round's other tensors are reduced
        assert [(s, k, name) for s, k, name, _ in mine["errors"]] == [(bad, 7, "g.7")], mine["errors"]
        assert "g.7" in mine["errors"][0][3] and f"rank {n - 1}" in mine["errors"][0][3], mine["errors"][0][3]
